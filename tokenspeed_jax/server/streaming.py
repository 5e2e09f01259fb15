"""The streamed answer of a completion (`stream: true`): OpenAI's server-sent events.

One `data: {...}` chunk per choice update, all with the request's id, created and model; chat
opens every choice with a role chunk and a completions request with `echo` with its prompt;
`stream_options.include_usage` puts `"usage": null` on each chunk and a last chunk with the
totals; the stream ends with `data: [DONE]`. Once the 200 is sent a failure can no longer change
the status, so it becomes a final error event (`errors.error_event`); a client gone ends the
stream silently. Either way the request's engine requests are aborted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tokenspeed_jax.server.choice import ChoiceState, Delta
from tokenspeed_jax.server.errors import error_event
from tokenspeed_jax.server.events import Disconnected
from tokenspeed_jax.server.respond import Completion
from tokenspeed_jax.server.tool_parse import ToolOutput

DONE = "data: [DONE]\n\n"


class _Chunks:
    """The SSE lines of one completion (see the module docstring)."""

    def __init__(self, c: Completion) -> None:
        self.c = c
        options = c.body.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.obj = "chat.completion.chunk" if c.chat else "text_completion"

    def chunk(self, choice_list: list[dict[str, Any]], use: dict[str, int] | None = None) -> str:
        out: dict[str, Any] = {**self.c.meta, "object": self.obj, "choices": choice_list}
        if self.include_usage:
            out["usage"] = use
        return f"data: {json.dumps(out)}\n\n"

    def opening(self) -> Iterator[str]:
        """What comes before any token: chat's role chunk, or the echoed prompt."""
        c = self.c
        if c.chat:  # the first chunk of every choice carries the role
            yield self.chunk(
                [
                    {
                        "index": ch.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for ch in c.choices
                ]
            )
        elif c.echo:
            yield self.chunk(
                [
                    {"index": ch.index, "text": c.echo, "logprobs": None, "finish_reason": None}
                    for ch in c.choices
                ]
            )

    def update(self, ch: ChoiceState, d: Delta, reason: str | None) -> Iterator[str]:
        """The chunks of one choice update (none for a token a tool parser holds back)."""
        c = self.c
        lp = c.logprobs_of(ch, d.token_ids, d.logprobs, d.top) if d.token_ids else None
        tools_out = c.tool_out[ch.index] if c.chat else None
        if tools_out is not None:
            yield from self._tool_update(tools_out, ch, d, reason, lp)
            return
        one: dict[str, Any]
        if c.chat:
            delta = {"content": d.text} if d.text else {}
            one = {"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            one = {
                "index": ch.index,
                "text": d.text,
                "logprobs": lp,
                "finish_reason": reason,
                "token_ids": d.token_ids,
            }
        yield self.chunk([one])

    def _tool_update(
        self, tools_out: ToolOutput, ch: ChoiceState, d: Delta, reason: str | None, lp: dict[str, Any] | None
    ) -> Iterator[str]:
        """Content held back around tool calls, the calls themselves at the end; the update's
        logprobs ride on its first delta."""
        for k, (delta, why) in enumerate(tools_out.deltas(d.text, reason)):
            part_lp = None if k else lp
            if delta or why or part_lp:  # no empty chunk per held token
                yield self.chunk(
                    [{"index": ch.index, "delta": delta, "logprobs": part_lp, "finish_reason": why}]
                )


async def sse(c: Completion) -> AsyncIterator[str]:
    """The event stream of `c`, to the end (see the module docstring)."""
    chunks = _Chunks(c)
    try:
        for line in chunks.opening():
            yield line
        async for ch, d, reason in c.events:
            for line in chunks.update(ch, d, reason):
                yield line
        if chunks.include_usage:
            yield chunks.chunk([], c.usage())
        yield DONE
    except Disconnected:
        return
    except Exception as e:  # noqa: BLE001 - this request only: a final error event
        status, message, code = c.fail(e)
        yield error_event(status, message, code=code)
    finally:
        c.abort()
