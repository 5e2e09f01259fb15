"""The engine events of one HTTP request, turned into per-choice deltas.

`choice_events` reads the queue `AsyncEngine.submit` returned and yields (choice, Delta,
finish_reason or None) until every choice has ended. While it waits it also watches three things
every `POLL_S` seconds, whether or not tokens keep arriving:
- the client: gone -> `Disconnected` (the caller aborts the request: its pages come back);
- the request's deadline (`--request-timeout-s`): passed -> `TimedOut` (the caller aborts it and
  answers 504 or a final error event);
- the server's drain (`server.drain`): once the shutdown grace has run out, every choice still
  generating is aborted and ends here with finish_reason "abort" (a clean end, not an error).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from tokenspeed_jax.server.async_engine import AsyncEngine
from tokenspeed_jax.server.choice import ChoiceState, Delta

POLL_S = 0.2  # how often a waiting handler checks the client, its deadline and the drain


class Disconnected(Exception):
    """The client hung up."""


class TimedOut(Exception):
    """The request ran past `--request-timeout-s`."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request did not finish within the server's request timeout of "
            f"{timeout_s:g} s (--request-timeout-s); it was aborted"
        )
        self.timeout_s = timeout_s


class EngineFailed(Exception):
    """A failed engine step: every request in it fails alike (HTTP 500, `engine_error`)."""


class RequestFailed(Exception):
    """The stepping thread failed this request alone (e.g. reading its tokens raised): 422."""


class Deadline:
    """When a request must be done: `timeout_s` after `start` (time.monotonic), or never."""

    def __init__(self, timeout_s: float | None, start: float | None = None) -> None:
        self.timeout_s = timeout_s
        begin = time.monotonic() if start is None else start
        self.at = None if timeout_s is None else begin + timeout_s

    def check(self) -> None:
        if self.at is not None and time.monotonic() >= self.at:
            assert self.timeout_s is not None
            raise TimedOut(self.timeout_s)


async def _next(
    queue: asyncio.Queue, http: Request, deadline: Deadline, aborting: Callable[[], bool], clock: list[float]
):
    """The next engine event; None once the drain aborts in-flight requests (and the events
    that had already arrived are consumed). Raises `Disconnected` / `TimedOut` within ~POLL_S of
    the client leaving or the deadline passing."""
    while True:
        deadline.check()
        if aborting():
            return None if queue.empty() else queue.get_nowait()
        now = time.monotonic()
        if now - clock[0] >= POLL_S:
            clock[0] = now
            if await http.is_disconnected():
                raise Disconnected()
        try:
            return await asyncio.wait_for(queue.get(), timeout=POLL_S)
        except TimeoutError:
            continue


async def choice_events(
    engine: AsyncEngine,
    queue: asyncio.Queue,
    choices: list[ChoiceState],
    rids: list[str],
    http: Request,
    deadline: Deadline,
    aborting: Callable[[], bool] = lambda: False,
) -> AsyncIterator[tuple[ChoiceState, Delta, str | None]]:
    """(choice, Delta, finish_reason or None) as tokens arrive, until every choice ends (see the
    module docstring). `aborting()`: the drain's grace is over (end every choice with "abort")."""
    done: set[int] = set()
    clock = [time.monotonic()]
    while len(done) < len(choices):
        item = await _next(queue, http, deadline, aborting, clock)
        if item is None:  # shutting down: end what is still generating, cleanly
            for ch in choices:
                if ch.index not in done:
                    engine.abort(rids[ch.index], finish_reason="abort")
                    done.add(ch.index)
                    ch.finish_reason = "stop" if ch.stopped else "abort"
                    yield ch, ch.feed([], None, None, final=True), ch.finish_reason
            return
        j, event = item
        if j in done:
            continue
        ch = choices[j]
        if event[0] == "error":
            raise EngineFailed(event[1])
        if event[0] == "failed":
            raise RequestFailed(event[1])
        if event[0] == "delta":
            d = ch.feed(event[1], event[2], event[3])
            if ch.stopped:  # a stop string: end this choice now, free its pages
                engine.abort(rids[j], finish_reason="stop")
                ch.finish_reason = "stop"
                done.add(j)
                yield ch, d, "stop"
            elif d.text or d.token_ids:
                yield ch, d, None
        else:
            d = ch.feed([], None, None, final=True)
            ch.finish_reason = "stop" if ch.stopped else event[1].finish_reason
            done.add(j)
            yield ch, d, ch.finish_reason
