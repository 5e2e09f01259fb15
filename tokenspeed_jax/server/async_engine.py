"""`AsyncEngine`: one background thread steps the engine; asyncio handlers await results.

The engine is not thread-safe, so every call into it (add, abort, step) holds one lock. The
thread sleeps while nothing is queued. After each step it pushes, to every subscribed request,
the tokens generated since the last push (streaming) and the final output once it finishes. A
failing step fails (and aborts) the requests in flight; the server keeps accepting new ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from tokenspeed_jax.engine import Engine
from tokenspeed_jax.outputs import CompletionOutput
from tokenspeed_jax.sampling_params import SamplingParams

log = logging.getLogger("tokenspeed_jax.server")


class _Subscriber:
    __slots__ = ("loop", "queue", "sent")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sent = 0

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Queue items are ("delta", list[int]), ("done", CompletionOutput) or ("error", str)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._subs: dict[str, _Subscriber] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="tokenspeed-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Queue a request (ValueError on bad input, nothing queued) and subscribe to it."""
        sub = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            rid = self.engine.add_request(prompt, params)
            self._subs[rid] = sub
        self._wake.set()
        return rid, sub.queue

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._subs.pop(request_id, None)
            self.engine.abort(request_id)

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stopped:
            with self._lock:
                busy = self.engine.has_unfinished()
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            with self._lock:
                try:
                    finished = self.engine.step()
                except Exception as e:  # noqa: BLE001 - keep serving; fail what was in flight
                    log.exception("engine step failed")
                    self._fail_all(f"engine step failed: {e}")
                    continue
                self._publish(finished)

    def _publish(self, finished: list[CompletionOutput]) -> None:
        sched = self.engine.scheduler
        for rid, sub in self._subs.items():
            req = sched.get_request(rid)
            if req is None:
                continue
            new = req.tokens[req.prompt_len + sub.sent :]
            if new:
                sub.sent += len(new)
                sub.push(("delta", list(new)))
        for out in finished:
            sub = self._subs.pop(out.request_id, None)
            if sub is None:
                continue
            tail = out.token_ids[sub.sent :]
            if tail:
                sub.push(("delta", list(tail)))
            sub.push(("done", out))

    def _fail_all(self, message: str) -> None:
        for rid, sub in list(self._subs.items()):
            self.engine.abort(rid)
            sub.push(("error", message))
        self._subs.clear()
