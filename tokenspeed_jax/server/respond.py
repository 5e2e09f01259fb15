"""Pieces of a completion response that do not depend on the app's state: `Completion`, one
admitted request as both response shapes see it (the streamed one is `server.streaming`); the
non-streaming body and answer; the error that ends one request after it was queued; tokenizer
calls whose failures are a 400 on the field the text came from."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import Response

from tokenspeed_jax.server.async_engine import AsyncEngine
from tokenspeed_jax.server.choice import ChoiceState, Delta
from tokenspeed_jax.server.errors import error_response
from tokenspeed_jax.server.events import Disconnected, EngineFailed, RequestFailed, TimedOut
from tokenspeed_jax.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenspeed_jax.server.tool_parse import ToolOutput

log = logging.getLogger("tokenspeed_jax.server")


def tokenizer_call(fn: Callable[[Any], Any], arg: Any) -> Any:
    """`fn(arg)` (encode / decode), whatever it raises turned into a ValueError naming it (a 400
    on the field the text came from: one request's bad text never becomes a 500)."""
    try:
        return fn(arg)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers raise TypeError, exceptions of their own
        raise ValueError(f"the tokenizer could not process this text ({type(e).__name__}: {e})") from None


def failure(e: Exception) -> tuple[int, str, str]:
    """(status, message, code) of an error that ended one request after it was queued."""
    if isinstance(e, TimedOut):
        return 504, str(e), "request_timeout"
    if isinstance(e, EngineFailed):
        return 500, str(e), "engine_error"
    if not isinstance(e, RequestFailed):
        log.error("request failed while its output was produced", exc_info=e)
    what = str(e) if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
    return (
        422,
        (f"this request failed while its output was produced ({what}); other requests are not affected"),
        "request_failed",
    )


def whole_body(
    chat: bool,
    meta: dict,
    choices: list[ChoiceState],
    tool_out: list,
    echo: str,
    logprobs_of: Callable[..., Any],
    use: dict,
) -> dict:
    """The non-streaming response body once every choice has ended."""
    out = []
    for ch in choices:
        lp = logprobs_of(ch, ch.tokens, ch.logprobs, ch.top)
        text = ch.text(final=True)
        if chat:
            message: dict = {"role": "assistant", "content": text}
            reason = ch.finish_reason
            parser = tool_out[ch.index]
            if parser is not None:
                content, calls, reason = parser.final(text, reason)
                message = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
            out.append({"index": ch.index, "message": message, "logprobs": lp, "finish_reason": reason})
        else:
            out.append(
                {
                    "index": ch.index,
                    "text": echo + text,
                    "logprobs": lp,
                    "finish_reason": ch.finish_reason,
                    "token_ids": ch.tokens,
                }
            )
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": out, "usage": use}


@dataclasses.dataclass
class Completion:
    """One admitted request: what both of its response shapes (streamed or whole) are built from,
    and the engine requests to abort however it ends."""

    body: CompletionRequest | ChatCompletionRequest
    chat: bool
    prompt_len: int
    choices: list[ChoiceState]
    tool_out: list[ToolOutput | None]  # per choice: its tool-call parser (None: no tools)
    echo: str  # the prompt's text a completions request with `echo` gets first
    meta: dict[str, Any]  # id, created, model: the same in every chunk
    rids: list[str]  # the engine request of each choice
    events: AsyncIterator[tuple[ChoiceState, Delta, str | None]]  # `choice_events`
    engine: AsyncEngine
    top_k: int  # top logprobs asked per token

    def usage(self) -> dict[str, int]:
        done = sum(len(c.tokens) for c in self.choices)
        return {
            "prompt_tokens": self.prompt_len,
            "completion_tokens": done,
            "total_tokens": self.prompt_len + done,
        }

    def logprobs_of(
        self, ch: ChoiceState, ids: list[int], lps: list[float], tops: list[Any]
    ) -> dict[str, Any] | None:
        """The logprobs object of these tokens in the request's own format (None: not asked)."""
        if not self.body.wants_logprobs():
            return None
        if self.chat:
            return ch.chat_logprobs(ids, lps, tops)
        return ch.completion_logprobs(ids, lps, tops, want_top=self.top_k > 0)

    def abort(self, reason: str | None = None) -> None:
        """Abort every engine request of this completion: a no-op once one finished, its pages
        back at once otherwise (called however the response ends)."""
        for rid in self.rids:
            self.engine.abort(rid, finish_reason=reason)

    def fail(self, e: Exception) -> tuple[int, str, str]:
        """(status, message, code) of the error that ended this request after it was queued; a
        timeout is first recorded as such (finish_reason "timeout", for the metrics)."""
        if isinstance(e, TimedOut):
            self.abort("timeout")
        return failure(e)


async def whole_response(c: Completion) -> Response | dict[str, Any]:
    """The non-streaming answer: the whole body once every choice has ended; a client gone
    meanwhile gets 499 (nobody reads it), any other failure this request's error body."""
    try:
        async for _ in c.events:
            pass
        return whole_body(c.chat, c.meta, c.choices, c.tool_out, c.echo, c.logprobs_of, c.usage())
    except Disconnected:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 - this request only: an OpenAI error body
        status, message, code = c.fail(e)
        return error_response(status, message, code=code)
    finally:
        c.abort()
