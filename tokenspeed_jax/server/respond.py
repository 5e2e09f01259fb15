"""Pieces of a completion response that do not depend on the app's state: the non-streaming
body, the error that ends one request after it was queued, tokenizer calls whose failures are a
400 on the field the text came from."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tokenspeed_jax.server.choice import ChoiceState
from tokenspeed_jax.server.events import EngineFailed, RequestFailed, TimedOut

log = logging.getLogger("tokenspeed_jax.server")


def tokenizer_call(fn: Callable[[Any], Any], arg: Any) -> Any:
    """`fn(arg)` (encode / decode), whatever it raises turned into a ValueError naming it (a 400
    on the field the text came from: one request's bad text never becomes a 500)."""
    try:
        return fn(arg)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers raise TypeError, exceptions of their own
        raise ValueError(f"the tokenizer could not process this text ({type(e).__name__}: {e})"
                         ) from None


def failure(e: Exception) -> tuple[int, str, str]:
    """(status, message, code) of an error that ended one request after it was queued."""
    if isinstance(e, TimedOut):
        return 504, str(e), "request_timeout"
    if isinstance(e, EngineFailed):
        return 500, str(e), "engine_error"
    if not isinstance(e, RequestFailed):
        log.error("request failed while its output was produced", exc_info=e)
    what = str(e) if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
    return 422, (f"this request failed while its output was produced ({what}); other requests "
                 f"are not affected"), "request_failed"


def whole_body(chat: bool, meta: dict, choices: list[ChoiceState], tool_out: list, echo: str,
               logprobs_of: Callable[..., Any], use: dict) -> dict:
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
            out.append({"index": ch.index, "message": message, "logprobs": lp,
                        "finish_reason": reason})
        else:
            out.append({"index": ch.index, "text": echo + text, "logprobs": lp,
                        "finish_reason": ch.finish_reason, "token_ids": ch.tokens})
    return {**meta, "object": "chat.completion" if chat else "text_completion",
            "choices": out, "usage": use}
