"""`StepPrograms`: the compiled step executables of one runner, one per step shape, and how they
are made ready: loaded from the executable store (`executables`), or traced, lowered and compiled
ahead of time (`jit(...).lower(...).compile()`), in a thread pool, and then stored.

Ahead of time, in parallel: tracing and lowering hold the GIL, so they run one at a time (a
lock); XLA's compile and the executable loads release it, so with W workers the compile of one
shape overlaps the tracing of the next and up to W compiles run at once. Longest first (the
largest token bucket and kv level compile slowest), which also makes the shape that covers
every step ready first.

Lazily (`cover` + `prepare_in_background`): a step whose shape is not ready yet runs as the
smallest ready shape that covers it (a larger token bucket only adds padding tokens, a higher kv
level only adds page-table columns; both drop every write and mask every read), while a
background thread compiles its own shape; so a shape compiled lazily never stalls the step loop.
Only when no ready shape covers it does the step wait for its compile (the first step of an
engine that warmed up nothing).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any

import jax

from tokenspeed_jax.runtime.executables import (
    STORE_COMPILE_OPTIONS,
    ExecutableStore,
    no_persistent_cache_writes,
    persistent_cache_hits,
)
from tokenspeed_jax.runtime.shapes import StepShape

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShapeReady:
    """How one step shape became ready: `source` "loaded" (from the executable store) or
    "compiled" (traced + lowered in `trace_s`, XLA-compiled in `compile_s`); `load_s` is the
    store read (a miss costs one file lookup)."""

    shape: StepShape
    source: str
    trace_s: float
    compile_s: float
    load_s: float
    background: bool = False

    @property
    def total_s(self) -> float:
        return self.trace_s + self.compile_s + self.load_s


class StepPrograms:
    """Ready executables by step shape.

    lower(shape) -> jax.stages.Lowered traces + lowers the step for `shape`; key(shape) -> str is
    its executable-store key (computed without tracing) or None when there is no store.
    """

    def __init__(
        self,
        lower: Callable[[StepShape], jax.stages.Lowered],
        key: Callable[[StepShape], str] | None,
        store: ExecutableStore | None,
        devices: list[Any] | None = None,
    ) -> None:
        self._lower, self._key, self.store, self.devices = lower, key, store, devices
        self.ready: dict[StepShape, jax.stages.Compiled] = {}
        self.records: list[ShapeReady] = []
        self._trace_lock = threading.Lock()  # tracing is Python: one at a time
        self._lock = threading.Lock()  # guards ready / records / _pending
        self._pending: dict[StepShape, Future] = {}  # claimed, not ready yet (any thread)
        self._background: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ one shape
    def get(self, shape: StepShape) -> jax.stages.Compiled | None:
        return self.ready.get(shape)

    def prepare(self, shape: StepShape, *, background: bool = False) -> jax.stages.Compiled:
        """The executable of `shape`, made ready now if it is not (waits for a compile of it
        already under way elsewhere). `background` only labels its record."""
        compiled = self.ready.get(shape)
        if compiled is not None:
            return compiled
        fut, mine = self._claim(shape)
        return self._fulfil(shape, fut, background) if mine else fut.result()

    def _claim(self, shape: StepShape) -> tuple[Future, bool]:
        """The future of `shape` being made ready, and whether the caller must make it."""
        with self._lock:
            fut = self._pending.get(shape)
            if fut is not None:
                return fut, False
            fut = Future()
            if shape in self.ready:  # finished since the caller looked
                fut.set_result(self.ready[shape])
                return fut, False
            self._pending[shape] = fut
            return fut, True

    def _fulfil(self, shape: StepShape, fut: Future, background: bool) -> jax.stages.Compiled:
        try:
            compiled = self._make(shape, background)
        except BaseException as e:
            with self._lock:
                del self._pending[shape]
            fut.set_exception(e)
            raise
        fut.set_result(compiled)
        return compiled

    def _make(self, shape: StepShape, background: bool) -> jax.stages.Compiled:
        t0 = time.perf_counter()
        key = self._key(shape) if self._key is not None else None
        compiled = None
        if key is not None and self.store is not None:
            compiled = self.store.load(key, self.devices)
        t1 = time.perf_counter()
        if compiled is not None:
            rec = ShapeReady(shape, "loaded", 0.0, 0.0, t1 - t0, background)
        else:
            with self._trace_lock:
                lowered = self._lower(shape)
            t2 = time.perf_counter()
            with persistent_cache_hits() as from_jax_cache:
                compiled = lowered.compile()
            if key is not None and self.store is not None:
                if from_jax_cache():
                    # what JAX's persistent cache served does not serialize whole (jaxlib 0.10
                    # CPU): the store gets a fresh compile (only when its own entry was missing)
                    with persistent_cache_hits() as again, no_persistent_cache_writes():
                        fresh = lowered.compile(compiler_options=STORE_COMPILE_OPTIONS)
                    if not again():
                        self.store.save(key, fresh)
                else:
                    self.store.save(key, compiled)
            t3 = time.perf_counter()
            rec = ShapeReady(shape, "compiled", t2 - t1, t3 - t2, t1 - t0, background)
        with self._lock:
            self.ready[shape] = compiled
            self.records.append(rec)
            self._pending.pop(shape, None)
        return compiled

    # ------------------------------------------------------------------ many shapes
    def prepare_many(self, shapes: Iterable[StepShape], *, workers: int = 2, progress: bool = False) -> int:
        """Make every shape ready, longest first, `workers` at a time; returns how many were not
        ready before. `progress`: a tqdm bar on stderr with each shape's time."""
        todo = sorted({s for s in shapes if s not in self.ready}, reverse=True)
        if not todo:
            return 0
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="step shapes", unit="shape", leave=True)
        try:
            with ThreadPoolExecutor(max(1, workers), thread_name_prefix="compile") as pool:
                futs = {pool.submit(self.prepare, s): s for s in todo}
                for fut in as_completed(futs):
                    fut.result()
                    if bar is not None:
                        rec = self.record_of(futs[fut])
                        if rec is not None:
                            bar.set_postfix_str(
                                f"{rec.shape.bucket}x{rec.shape.level} {rec.source} {rec.total_s:.1f}s"
                            )
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return len(todo)

    def record_of(self, shape: StepShape) -> ShapeReady | None:
        with self._lock:
            return next((r for r in reversed(self.records) if r.shape == shape), None)

    # ------------------------------------------------------------------ lazily
    def cover(self, shape: StepShape) -> StepShape | None:
        """The smallest ready shape at least as large as `shape` in both dimensions, or None."""
        best = None
        with self._lock:
            ready = list(self.ready)
        for s in ready:
            if s.bucket >= shape.bucket and s.level >= shape.level and (best is None or s < best):
                best = s
        return best

    def prepare_in_background(self, shape: StepShape) -> None:
        """Start making `shape` ready on the background thread (no-op if ready or under way).
        The shape is claimed here, so `wait_background` sees it before the thread starts."""
        fut, mine = self._claim(shape)
        if not mine:
            return
        with self._lock:
            if self._background is None:
                self._background = ThreadPoolExecutor(1, thread_name_prefix="lazy-compile")
            pool = self._background
        pool.submit(self._fulfil_logged, shape, fut)

    def _fulfil_logged(self, shape: StepShape, fut: Future) -> None:
        try:
            self._fulfil(shape, fut, background=True)
        except Exception:  # noqa: BLE001 - the covering shape keeps serving; say why
            logger.exception("background compile of step shape %s failed", shape)

    def wait_background(self) -> None:
        """Block until every compile under way or queued so far has finished (tests, shutdown)."""
        with self._lock:
            pending = list(self._pending.values())
        for fut in pending:
            fut.exception()

    # ------------------------------------------------------------------ report
    def summary(self) -> dict[str, float]:
        """Counts and summed seconds over every shape made ready so far."""
        with self._lock:
            recs = list(self.records)
        compiled = [r for r in recs if r.source == "compiled"]
        return {
            "shapes_ready": len(recs),
            "shapes_compiled": len(compiled),
            "shapes_loaded": len(recs) - len(compiled),
            "shapes_background": sum(r.background for r in recs),
            "trace_s": sum(r.trace_s for r in recs),
            "compile_s": sum(r.compile_s for r in recs),
            "load_s": sum(r.load_s for r in recs),
        }
