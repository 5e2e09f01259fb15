"""The stop rule: when a request is finished, and why (vLLM's `check_stop`).

A request ends on one of its stop token ids ("stop"; the stop token is kept as its last token),
or when its length limit is reached ("length"): `max_new_tokens` generated, or
`max_context_len` tokens in all, whichever comes first. The rule lives here alone: `update`
applies `check_stop` to every token it appends, and the planner asks it ahead of time whether
the tokens still on the device will end a request (`Request.finishes_by_length`: a stop token
can never be known ahead, a length limit can), and how many drafts a row may carry before its
limit (`tokens_left`, the length half counted in tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # request.py asks this rule (finishes_by_length): a type-only import
    from scheduler.request import Request

FinishReason = Literal["stop", "length"]


def check_stop(
    req: Request, max_context_len: int, token: int | None = None, *, ahead: int = 0
) -> FinishReason | None:
    """Why `req` is finished with its known tokens (None: it goes on). token: its newest
    token, already appended, when it is known (a stop id ends the request first); ahead:
    tokens still to come that count toward the length (those still on the device).

    Runs for every token `update` appends, so the length half is written out here rather than
    as a call to `tokens_left` (the same limit: length iff `tokens_left(...) <= 0`)."""
    if token is not None and token in req.sampling.stop_token_ids:
        return "stop"
    total = len(req.tokens) + ahead
    if total - req.prompt_len >= req.max_new_tokens or total >= max_context_len:
        return "length"
    return None


def tokens_left(req: Request, max_context_len: int) -> int:
    """Tokens `req` may still append before `check_stop` ends it by length (<= 0: it has
    ended): the fewer of those left to `max_new_tokens` and to `max_context_len`."""
    total = len(req.tokens)
    return min(req.max_new_tokens - (total - req.prompt_len), max_context_len - total)
