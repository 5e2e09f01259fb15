"""One choice of a completion: incremental detokenization, stop strings, logprob records.

Stop strings are matched on the decoded text. While the text's tail could still grow into a stop
string (it ends with a proper prefix of one) that tail is held back, so a streamed client never
sees the start of a stop string that later completes; once a stop string appears the text is cut
before it, the stop text itself is never returned, and the finish reason is "stop". A trailing
partial UTF-8 character (U+FFFD from a partial byte sequence) is held back the same way.
"""

from __future__ import annotations

import dataclasses


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that could be the beginning of a stop string."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return keep


def find_stop(text: str, stops: list[str]) -> int:
    """Index of the earliest stop string in `text`, -1 if none."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@dataclasses.dataclass
class Delta:
    """What one update adds to a choice: text, and the entries of the tokens that arrived."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


class ChoiceState:
    """Accumulates one request's tokens; `feed` returns the text that is safe to emit."""

    def __init__(self, index: int, tokenizer, stops: list[str]) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.stops = stops
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.emitted = ""  # text already handed out
        self.stopped = False  # a stop string was found (the request is to be aborted)
        self.finish_reason: str | None = None
        self.text_offset = 0  # where the next completions-logprobs token starts in the text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

    def text(self, final: bool) -> str:
        """The choice's text so far: cut before the first stop string; when not `final`, without
        the tail that could still become a stop string or a complete character."""
        text = self._decode(self.tokens)
        hit = find_stop(text, self.stops)
        if hit >= 0:
            self.stopped = True
            return text[:hit]
        if final:
            return text
        text = text[:len(text) - held_back(text, self.stops)]
        return text.rstrip("\ufffd")

    def feed(self, token_ids: list[int], logprobs: list[float] | None,
             top: list[list[tuple[int, float]]] | None, final: bool = False) -> Delta:
        if self.stopped:  # tokens that arrived after the stop string are not part of the choice
            return Delta("", [], [], [])
        self.tokens += token_ids
        lp = list(logprobs or [])[:len(token_ids)]
        tp = list(top or [])[:len(token_ids)]
        self.logprobs += lp
        self.top += tp
        text = self.text(final or False)
        delta = ""
        if text.startswith(self.emitted) and len(text) > len(self.emitted):
            delta = text[len(self.emitted):]
            self.emitted = text
        return Delta(delta, list(token_ids), lp, tp)

    # ------------------------------------------------------------------ logprob records
    def token_str(self, tok: int) -> str:
        return self._decode([tok])

    def completion_logprobs(self, ids: list[int], lps: list[float], tops: list,
                            want_top: bool) -> dict:
        """OpenAI completions `logprobs` object for `ids`; text offsets continue from the
        previous call (start `text_offset` at the echoed prompt's length)."""
        offsets, off = [], self.text_offset
        for t in ids:
            offsets.append(off)
            off += len(self.token_str(t))
        self.text_offset = off
        return {
            "tokens": [self.token_str(t) for t in ids],
            "token_logprobs": lps,
            "top_logprobs": [self._top_dict(top) for top in tops] if want_top else None,
            "text_offset": offsets,
        }

    def _top_dict(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """{token text: logprob}; tokens that decode alike (e.g. partial UTF-8 bytes) keep the
        most likely one's value, as the completions format is keyed by text."""
        out: dict[str, float] = {}
        for i, v in top:
            out.setdefault(self.token_str(i), v)
        return out

    def chat_logprobs(self, ids: list[int], lps: list[float], tops: list) -> dict:
        """OpenAI chat `logprobs` object ({"content": [...]}) for `ids`."""

        def entry(t: int, v: float) -> dict:
            s = self.token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        content = []
        for j, (t, v) in enumerate(zip(ids, lps)):
            e = entry(t, v)
            e["top_logprobs"] = [entry(i, x) for i, x in tops[j]] if j < len(tops) else []
            content.append(e)
        return {"content": content}
