"""One choice of a completion: incremental detokenization, stop strings, logprob records.

Stop strings are matched on the decoded text. While the text's tail could still grow into a stop
string (it ends with a proper prefix of one) that tail is held back, so a streamed client never
sees the start of a stop string that later completes; once a stop string appears the text is cut
before it, the stop text itself is never returned, and the finish reason is "stop". A trailing
partial UTF-8 character (U+FFFD from a partial byte sequence) is held back the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import re


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


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character each byte is spelled with
    in a ByteLevel BPE vocabulary -> the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(backend) -> str:
    """The `tokenizers` decoder chain's class names (e.g. "ByteLevel", "Sequence[ByteFallback,
    Metaspace...]" as its JSON), to tell how vocabulary pieces spell bytes."""
    decoder = getattr(backend, "decoder", None)
    return "" if decoder is None else repr(decoder) + type(decoder).__name__


def token_bytes(tokenizer, tok: int) -> list[int]:
    """The raw bytes of token `tok`, which clients concatenate to rebuild characters split across
    tokens (the UTF-8 of its decoded text would be U+FFFD for such a piece): the byte itself for
    the byte tokenizer; for a `tokenizers` vocabulary the piece mapped back through GPT-2's byte
    alphabet (ByteLevel) or its `<0xAB>` byte-fallback / `▁` spelling (SentencePiece-style).
    Anything else: the UTF-8 of the decoded text."""
    if tokenizer is None:
        return []
    if type(tokenizer).__name__ == "ByteTokenizer":
        return [tok] if 0 <= tok < 256 else []
    backend = getattr(tokenizer, "backend", None)
    piece = backend.id_to_token(tok) if backend is not None else None
    if piece is not None:
        kinds = _decoder_kinds(backend)
        decoder = _byte_decoder()
        if "ByteLevel" in kinds and all(c in decoder for c in piece):
            return [decoder[c] for c in piece]
        if (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            return [int(m.group(1), 16)]
        if "Metaspace" in kinds or "Replace" in kinds:
            return list(piece.replace("\u2581", " ").encode("utf-8"))
    return list(tokenizer.decode([tok]).encode("utf-8"))


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
        text = text[: len(text) - held_back(text, self.stops)]
        return text.rstrip("\ufffd")

    def feed(
        self,
        token_ids: list[int],
        logprobs: list[float] | None,
        top: list[list[tuple[int, float]]] | None,
        final: bool = False,
    ) -> Delta:
        if self.stopped:  # tokens that arrived after the stop string are not part of the choice
            return Delta("", [], [], [])
        self.tokens += token_ids
        lp = list(logprobs or [])[: len(token_ids)]
        tp = list(top or [])[: len(token_ids)]
        self.logprobs += lp
        self.top += tp
        text = self.text(final or False)
        delta = ""
        if text.startswith(self.emitted) and len(text) > len(self.emitted):
            delta = text[len(self.emitted) :]
            self.emitted = text
        return Delta(delta, list(token_ids), lp, tp)

    # ------------------------------------------------------------------ logprob records
    def token_str(self, tok: int) -> str:
        return self._decode([tok])

    def completion_logprobs(self, ids: list[int], lps: list[float], tops: list, want_top: bool) -> dict:
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
            return {"token": s, "logprob": v, "bytes": token_bytes(self.tokenizer, t)}

        content = []
        for j, (t, v) in enumerate(zip(ids, lps)):
            e = entry(t, v)
            e["top_logprobs"] = [entry(i, x) for i, x in tops[j]] if j < len(tops) else []
            content.append(e)
        return {"content": content}
