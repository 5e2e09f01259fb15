"""Per-replica bookkeeping of `AsyncEngine`: the subscribers its requests' events go to, the
deferred sibling samples, and what its stepping thread reports."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

from tokenspeed_jax.engine.engine import CheckedPrompt, Engine


class Subscriber:
    """One sample's feed into the queue its request shares with its siblings (items are tagged
    with the sample's index). `sent`: tokens pushed so far; `submitted`: when it was queued
    (perf_counter), for its queue time."""

    __slots__ = ("loop", "queue", "sent", "index", "submitted")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int) -> None:
        self.loop = loop
        self.queue = queue
        self.index = index
        self.sent = 0
        self.submitted = time.perf_counter()

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))


# How long the stepping thread lets request handlers that wait for the lock go first.
HANDLER_GRACE_S = 0.05


class ReplicaState:
    """One engine, its lock, its stepping thread's wake-up event and state, the subscribers of
    its requests (`unscheduled`: those no step has scheduled yet) and its deferred sibling
    samples.

    The lock is held for a whole `Engine.step`, and the stepping thread takes it again right
    after releasing it; a plain lock gives no order, so a request handler (on the server's one
    event loop thread, which is frozen while it waits) may lose that race to the next step too.
    Handlers take it with `urgent()`, and the stepping thread calls `let_handlers_in()` before
    each acquire, so a waiting handler goes next: it waits for at most the step in flight.
    The queue-limit check reads `Scheduler.num_waiting` without the lock at all."""

    def __init__(self, index: int, engine: Engine) -> None:
        self.index = index
        self.engine = engine
        self.lock = threading.Lock()
        self._waiting_handlers = 0
        self._count_lock = threading.Lock()
        self.wake = threading.Event()
        self.subs: dict[str, Subscriber] = {}
        self.unscheduled: dict[str, Subscriber] = {}
        # first sample's request id -> [(request id, validated sample)] queued once it has prefilled
        self.deferred: dict[str, list[tuple[str, CheckedPrompt]]] = {}
        self.ready = False
        self.warmup_s = 0.0
        self.compiled = 0

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """The lock, for a request handler: ahead of the stepping thread's next step."""
        with self._count_lock:
            self._waiting_handlers += 1
        try:
            self.lock.acquire()
        finally:
            with self._count_lock:
                self._waiting_handlers -= 1
        try:
            yield
        finally:
            self.lock.release()

    def let_handlers_in(self, grace_s: float = HANDLER_GRACE_S) -> None:
        """Stepping thread, lock not held: wait (up to `grace_s`) while handlers wait for the
        lock, so they get it before the next step."""
        end = time.monotonic() + grace_s
        while self._waiting_handlers and time.monotonic() < end:
            time.sleep(0.0002)

    def forget(self, rid: str) -> Subscriber | None:
        """Drop request `rid` (lock held): its place among the deferred samples and its
        subscriber, which is returned; the engine is not touched."""
        self.unscheduled.pop(rid, None)
        for first, rest in list(self.deferred.items()):
            rest[:] = [x for x in rest if x[0] != rid]
            if not rest:
                del self.deferred[first]
        return self.subs.pop(rid, None)
