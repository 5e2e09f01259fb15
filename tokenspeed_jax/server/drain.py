"""Graceful shutdown: SIGTERM / Ctrl-C drain the server instead of cutting its requests off.

On the first SIGTERM or SIGINT (`DrainingServer.handle_exit`):
1. the server stops admitting: new completions get 503 (`server_shutting_down`, with
   `Retry-After`) in an OpenAI error body, and `/health` answers 503 {"status": "draining"} so a
   load balancer takes the instance out; the port stays open meanwhile, so clients get that
   answer rather than a refused connection;
2. requests in flight keep generating for up to `--shutdown-grace-s` seconds;
3. what is still generating then is aborted: each such choice ends with finish_reason "abort"
   (streamed: a last chunk, then `[DONE]`; non-streaming: the text so far), and its pages come
   back; after `ABORT_WAIT_S` any request whose handler did not end it is aborted in the engine
   directly;
4. uvicorn then shuts down as usual (listeners closed, open responses flushed, the engine
   threads stopped) and the process exits with status 0.
A second signal skips what is left of the grace (step 3 at once); a third forces the exit.

uvicorn's own handling would close the listening socket at once and, after shutting down,
re-raise the signal (exit status 143 for SIGTERM), which is what the subclass replaces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi.responses import JSONResponse

from tokenspeed_jax.server.errors import error_response

log = logging.getLogger("tokenspeed_jax.server")

DEFAULT_SHUTDOWN_GRACE_S = 30.0
ABORT_WAIT_S = 3.0  # after the grace: time for handlers to end their aborted choices
FLUSH_S = 5.0  # uvicorn's timeout_graceful_shutdown: open responses finish writing


class Drain:
    """The server's shutdown state, shared by the app (admission, /health, the handlers) and the
    uvicorn server that receives the signal.

    live(): requests the engine still generates for (`AsyncEngine.num_live`); abort_rest():
    abort them all in the engine (both set by the app once its engine exists)."""

    def __init__(
        self, grace_s: float = DEFAULT_SHUTDOWN_GRACE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.grace_s = float(grace_s)
        self.clock = clock
        self.started_at: float | None = None
        self.aborting_at: float | None = None
        self.live: Callable[[], int] = lambda: 0
        self.abort_rest: Callable[[], int] = lambda: 0

    @property
    def draining(self) -> bool:
        """A shutdown has begun: refuse new requests, /health 503."""
        return self.started_at is not None

    def aborting(self) -> bool:
        """The grace is over: handlers end their remaining choices with "abort"."""
        if (
            self.aborting_at is None
            and self.started_at is not None
            and self.clock() >= self.started_at + self.grace_s
        ):
            self.aborting_at = self.clock()
        return self.aborting_at is not None

    def begin(self) -> None:
        """Start draining (first signal); a later call skips the rest of the grace."""
        if self.started_at is None:
            self.started_at = self.clock()
            log.info(
                "shutting down: no new requests; %d in flight get up to %gs to finish (--shutdown-grace-s)",
                self.live(),
                self.grace_s,
            )
        elif self.aborting_at is None:
            self.aborting_at = self.clock()
            log.info("second signal: aborting the %d requests in flight now", self.live())

    def done(self) -> bool:
        """Whether the server may shut down now (polled every 0.1 s once draining): nothing is in
        flight, or the grace and `ABORT_WAIT_S` after it are over (the rest is aborted then)."""
        if self.started_at is None:
            return False
        if self.live() == 0:
            return True
        if not self.aborting():
            return False
        assert self.aborting_at is not None
        if self.clock() < self.aborting_at + ABORT_WAIT_S:
            return False
        n = self.abort_rest()
        if n:
            log.warning("shutdown: %d requests aborted in the engine (their handlers did not end them)", n)
        return True

    def refusal(self) -> JSONResponse:
        """The 503 a request gets while draining."""
        return error_response(
            503,
            "the server is shutting down and accepts no new requests; retry on another instance",
            code="server_shutting_down",
            headers={"Retry-After": "1"},
        )


class DrainingServer(uvicorn.Server):
    """uvicorn's server with `Drain`'s signal handling (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded for re-raising (uvicorn would re-raise it after shutting down: exit 143)
        self.signals += 1
        if self.signals >= 3:
            self.should_exit = self.force_exit = True
            return
        self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.drain.done()


def serve(app: Any, host: str, port: int, *, log_level: str = "info") -> None:
    """Run `app` (from `build_app`, which put its `Drain` on `app.state.drain`) until a signal
    has drained it; returns normally (exit status 0)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(FLUSH_S)
    )
    DrainingServer(config, app.state.drain).run()
