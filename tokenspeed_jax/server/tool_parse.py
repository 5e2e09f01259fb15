"""A chat reply -> OpenAI `tool_calls`, whole (non-streaming) or as it streams.

Formats, by tool_choice (`tokenspeed_jax.server.tools`):
  auto      `<tool_call>{"name": f, "arguments": {...}}</tool_call>` blocks (Hermes / Qwen; the
            last one may lack its closing tag when the model stopped right after the JSON), or
            the whole reply a bare JSON call object / non-empty array of them. "parameters" is
            accepted for "arguments", and arguments given as JSON text are unwrapped. A call of an
            unknown function, or any block that does not parse, leaves the whole reply as plain
            content. content = the text outside the blocks (text before the first block with its
            trailing whitespace dropped, then each later piece stripped, joined by newlines), null
            if empty. parallel_tool_calls=false keeps the first call.
  required  the reply is a JSON array of {"name", "parameters"} (the grammar guarantees it unless
            the reply was cut); content null.
  named     the whole reply is the arguments of the named function (even when cut).
finish_reason is "tool_calls" when calls were parsed from a complete reply, else the engine's
("length" for a cut reply).

Streaming (`ToolOutput.feed`): under auto, text streams as content except what could still
become part of a call: a tail that is a prefix of `<tool_call>`, trailing whitespace (dropped
before a call), leading whitespace, and everything once a block opens or once the reply starts
with `{` or `[` (a possible bare call). The calls are emitted when the reply ends. Under
required / named nothing streams until the end. The streamed content always adds up to the
non-streaming content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from typing import Any

from tokenspeed_jax.server.tools import ToolPlan

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_MISSING = object()


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI tool call (arguments as JSON text), with a fresh id."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_of(obj: Any, known: Collection[str]) -> dict[str, Any] | None:
    """{"name", "arguments" | "parameters"} as a call; None if it is not one of a known tool."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", _MISSING))
    if not isinstance(name, str) or name not in known or args is _MISSING:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return new_call(name, json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return _MISSING


def _calls_of(value: Any, known: Collection[str]) -> list[dict[str, Any]] | None:
    """A call object or a non-empty array of them; None if any entry is not a call."""
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(v, known) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_auto(text: str, known: Collection[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a free reply; calls == [] means plain content (`text` unchanged)."""
    known = set(known)
    if TOOL_OPEN not in text:
        stripped = text.strip()
        if stripped[:1] in ("{", "["):
            calls = _calls_of(_loads(stripped), known)
            if calls:
                return None, calls
        return text, []
    pieces, calls, rest = [], [], text
    while True:
        i = rest.find(TOOL_OPEN)
        if i < 0:
            pieces.append(rest)
            break
        pieces.append(rest[:i])
        rest = rest[i + len(TOOL_OPEN) :]
        j = rest.find(TOOL_CLOSE)
        body, rest = (rest, "") if j < 0 else (rest[:j], rest[j + len(TOOL_CLOSE) :])
        call = _call_of(_loads(body.strip()), known)
        if call is None:
            return text, []
        calls.append(call)
    kept = [pieces[0].rstrip(), *(p.strip() for p in pieces[1:])]
    return "\n".join(p for p in kept if p) or None, calls


def parse_required(text: str, known: Collection[str]) -> list[dict[str, Any]]:
    """The calls of a `required` reply ([] if it does not parse, e.g. cut by max_tokens)."""
    value = _loads(text)
    if not isinstance(value, list) or not all(isinstance(v, dict) and "parameters" in v for v in value):
        return []
    return _calls_of(value, set(known)) or []


def _held(text: str) -> int:
    """Characters at the end of `text` that may still belong to a call: trailing whitespace
    and a proper prefix of `<tool_call>` (with the whitespace before it)."""
    keep = 0
    for k in range(min(len(TOOL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_OPEN[:k]):
            keep = k
            break
    body = text[: len(text) - keep]
    return keep + len(body) - len(body.rstrip())


class ToolOutput:
    """One choice's reply under a tool plan: `feed` the text deltas as they come (content that
    is safe to stream comes back), then `finish` once; or `final` for a whole reply."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.emitted = ""
        self.blocked = plan.mode != "auto"  # nothing more streams as content

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.blocked:
            return ""
        head = self.text.lstrip()
        if not head:
            return ""
        if head[0] in "{[" and not self.emitted:  # the whole reply may be a bare call
            self.blocked = True
            return ""
        i = self.text.find(TOOL_OPEN)
        safe = self.text[:i] if i >= 0 else self.text
        safe = safe[: len(safe) - _held(safe)]
        self.blocked = i >= 0
        out = safe[len(self.emitted) :]
        self.emitted = safe if len(safe) > len(self.emitted) else self.emitted
        return out

    def final(self, text: str, reason: str | None) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """(content, calls, finish_reason) of the whole reply `text`."""
        mode, known = self.plan.mode, self.plan.params
        if mode == "named":
            assert self.plan.named is not None
            complete = isinstance(_loads(text), dict)
            return (
                None,
                [new_call(self.plan.named, text)],
                ("tool_calls" if complete and reason != "length" else reason),
            )
        calls = parse_required(text, known) if mode == "required" else []
        content: str | None = text
        if mode == "auto":
            content, calls = parse_auto(text, known)
            if not self.plan.parallel:
                calls = calls[:1]
        if not calls:
            return text, [], reason
        return (
            (None if mode == "required" else content),
            calls,
            ("tool_calls" if reason != "length" else reason),
        )

    def finish(self, delta: str, reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """The last delta: (content still to stream, calls, finish_reason)."""
        self.text += delta
        content, calls, reason = self.final(self.text, reason)
        content = content or ""
        assert content.startswith(self.emitted), (content, self.emitted)
        return content[len(self.emitted) :], calls, reason

    def deltas(self, delta: str, reason: str | None) -> list[tuple[dict[str, Any], str | None]]:
        """Chat chunk deltas for `delta` (the reply's last text when `reason` is set): content,
        then one delta per tool call, then an empty delta carrying the finish_reason."""
        if reason is None:
            text = self.feed(delta)
            return [({"content": text} if text else {}, None)]
        text, calls, reason = self.finish(delta, reason)
        out: list[tuple[dict[str, Any], str | None]] = [({"content": text}, None)] if text else []
        out += [({"tool_calls": [{"index": i, **c}]}, None) for i, c in enumerate(calls)]
        return [*out, ({}, reason)]
