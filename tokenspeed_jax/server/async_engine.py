"""`AsyncEngine`: background threads step the engines (one per data-parallel replica); asyncio
handlers await results.

An engine is not thread-safe, so every call into one (add, abort, step) holds that replica's
lock; request handlers take it ahead of the next step (`ReplicaState.urgent`). A replica's
thread first compiles every step shape (`Engine.warmup`), then sleeps while nothing is queued.
After each step it pushes, to every subscribed request, the tokens generated since the last
push with their logprobs (streaming) and the final output once it finishes. A failing step
fails (and aborts) the requests in flight; the server keeps accepting new ones.

Routing (`tokenspeed_jax.engine.replicas.Replicas`, `route=`): by default ("prefix") a request
goes to the replica whose prefix cache holds the longest prefix of its prompt; ties go to the
least loaded (running + waiting requests, deferred samples included). "load" picks the fewest
outstanding tokens instead. The n samples of one request stay on one replica and the 2nd..n-th are
queued only once the first has computed its prompt, so they share its prompt pages through the
prefix cache instead of each computing the prompt. Tokens stream from `Engine.stream`.

Isolation: what the stepping thread does for one request after a step (pushing its tokens,
`on_finish`, `on_scheduled`, queueing a deferred sample) is guarded per request: an exception
there fails that request alone (a "failed" event; it is aborted) and the thread keeps stepping.

Queue time: the first step that schedules a sample reports the seconds since `submit` to
`on_scheduled` (the server's `tokenspeed_queue_time_seconds` histogram).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from tokenspeed_jax.engine.engine import Engine
from tokenspeed_jax.engine.replicas import Replicas
from tokenspeed_jax.outputs import CompletionOutput
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.server.replica_state import ReplicaState, Subscriber

log = logging.getLogger("tokenspeed_jax.server")


class AsyncEngine:
    """Queue items are (sample index, event) with event ("delta", ids, logprobs, top),
    ("done", CompletionOutput), ("error", str) (a failed step: every request in it) or
    ("failed", str) (this request alone).

    engines: the data-parallel replicas. warmup: compile every step shape before serving
    (`ready` turns True after). on_finish(output): called on the stepping thread for each
    finished request (metrics). on_scheduled(seconds): called there once per sample, by the
    first step that schedules it, with its time queued since `submit`. route: the routing
    policy over the replicas, "prefix" (the default) or "load"
    (`tokenspeed_jax.engine.replicas`)."""

    def __init__(
        self,
        engines: Engine | Sequence[Engine],
        *,
        warmup: bool = True,
        on_finish: Callable[[CompletionOutput], None] | None = None,
        on_scheduled: Callable[[float], None] | None = None,
        route: str = "prefix",
    ) -> None:
        engines = [engines] if isinstance(engines, Engine) else list(engines)
        self.router = Replicas(engines, route=route)
        self.replicas = [ReplicaState(i, e) for i, e in enumerate(engines)]
        self.engine = engines[0]
        self._on_finish = on_finish
        self._on_scheduled = on_scheduled
        self._warmup = warmup
        self._stopped = False
        self._owner: dict[str, ReplicaState] = {}
        self._threads = [
            threading.Thread(target=self._loop, args=(r,), daemon=True, name=f"tokenspeed-engine-{r.index}")
            for r in self.replicas
        ]
        for t in self._threads:
            t.start()

    @property
    def ready(self) -> bool:
        return all(r.ready for r in self.replicas)

    # ------------------------------------------------------------------ requests
    def _route(self, prompt: list[int]) -> ReplicaState:
        if len(self.replicas) == 1:
            return self.replicas[0]
        with contextlib.ExitStack() as stack:  # a consistent view of every replica
            for r in self.replicas:
                stack.enter_context(r.urgent())
            i = self.router.route(prompt, held=self._held)
        return self.replicas[i]

    def _held(self, k: int) -> list[int]:
        """Outstanding tokens of the samples deferred on replica k (not in its engine yet)."""
        return [
            len(c.ids) + c.params.max_tokens for rest in self.replicas[k].deferred.values() for _, c in rest
        ]

    def submit(
        self, prompt: list[int], params: SamplingParams | Sequence[SamplingParams]
    ) -> tuple[list[str], asyncio.Queue]:
        """Queue one request per params entry (the n samples of one prompt) on one replica and
        subscribe to them: returns their request ids and the queue of their events. ValueError
        on bad input: then nothing is queued."""
        plist = [params] if isinstance(params, SamplingParams) else list(params)
        loop = asyncio.get_running_loop()
        # all-or-nothing: validate every sample first (once: queued below as checked)
        checked = [self.engine.validate(prompt, p) for p in plist]
        rep = self._route(checked[0].ids)
        queue: asyncio.Queue = asyncio.Queue()
        with rep.urgent():
            # ids unique over all replicas: `_owner` maps them back to theirs
            rid = rep.engine.add_request(checked[0], plist[0], self.router.new_request_id())
            rids = [rid] + [f"{rid}-n{j}" for j in range(1, len(plist))]
            if len(plist) > 1:
                rep.deferred[rid] = list(zip(rids[1:], checked[1:]))
            for j, r_id in enumerate(rids):
                rep.subs[r_id] = rep.unscheduled[r_id] = Subscriber(loop, queue, j)
                self._owner[r_id] = rep
        rep.wake.set()
        return rids, queue

    def abort(self, request_id: str, finish_reason: str | None = None) -> None:
        """Drop a request (its pages come back at once). finish_reason: the request ended
        normally from the client's view (a stop string: "stop"), so it is reported to
        `on_finish` with that reason; None = a real abort (client gone)."""
        rep = self._owner.get(request_id)
        if rep is None:
            return
        with rep.urgent():
            self._detach(rep, request_id)
            out = self._engine_abort(rep, request_id)
        if out is not None and finish_reason is not None:
            self._finished(dataclasses.replace(out, finish_reason=finish_reason))

    def num_live(self) -> int:
        """Requests (samples) still generating for a subscriber, on every replica."""
        return len(self._owner)

    def abort_all(self, message: str = "aborted: the server is shutting down") -> int:
        """Abort every live request (shutdown's last resort, for requests no handler ended):
        their subscribers get a "failed" event. Returns how many there were."""
        rids = list(self._owner)
        for rid in rids:
            rep = self._owner.get(rid)
            if rep is not None:
                with rep.urgent():
                    self._fail_one(rep, rid, message)
        return len(rids)

    @staticmethod
    def _engine_abort(rep: ReplicaState, rid: str) -> CompletionOutput | None:
        """`Engine.abort` (lock held); an exception building the output (e.g. the tokenizer
        failing on its tokens) is logged: the request is gone from the scheduler by then, its
        pages back."""
        try:
            return rep.engine.abort(rid)
        except Exception:  # noqa: BLE001 - one request's output must not fail its caller
            log.exception("aborting request %s: building its output failed", rid)
            return None

    def _detach(self, rep: ReplicaState, rid: str) -> Subscriber | None:
        """Forget request `rid` (lock held; `ReplicaState.forget`) and its owner entry."""
        self._owner.pop(rid, None)
        return rep.forget(rid)

    def waiting_stats(self) -> list[dict]:
        """Per replica {"num_waiting": n}, from its scheduler alone: cheap enough for every
        request (`stats()` also summarises up to 100k step timings under the replica's lock)."""
        out = []
        for r in self.replicas:
            # a plain read, safe without the lock: no wait for the step in flight
            out.append({"num_waiting": r.engine.scheduler.num_waiting})
        return out

    def stats(self) -> list[dict]:
        out = []
        for r in self.replicas:
            with r.urgent():
                out.append(r.engine.stats())
        return out

    def shutdown(self) -> None:
        self._stopped = True
        for r in self.replicas:
            r.wake.set()
        for t in self._threads:
            t.join(timeout=5)

    # ------------------------------------------------------------------ stepping thread
    def _loop(self, rep: ReplicaState) -> None:
        if self._warmup:
            t0 = time.perf_counter()
            with rep.lock:
                try:
                    rep.compiled = rep.engine.warmup()
                except Exception:  # noqa: BLE001 - serve anyway: shapes then compile on first use
                    log.exception("replica %d: warm-up failed; step shapes compile on first use", rep.index)
            rep.warmup_s = time.perf_counter() - t0
            up = rep.engine.startup_stats()
            log.info(
                "replica %d ready: %d step shapes in %.1fs (%d compiled: trace %.1fs + XLA "
                "%.1fs; %d loaded from the executable cache in %.1fs; model load %.1fs)",
                rep.index,
                rep.compiled,
                rep.warmup_s,
                up.get("shapes_compiled", 0),
                up.get("trace_s", 0.0),
                up.get("compile_s", 0.0),
                up.get("shapes_loaded", 0),
                up.get("load_exe_s", 0.0),
                up.get("load_s", 0.0),
            )
        rep.ready = True
        while not self._stopped:
            with rep.lock:
                busy = rep.engine.has_unfinished()
            if not busy:
                rep.wake.wait(timeout=0.5)
                rep.wake.clear()
                continue
            rep.let_handlers_in()
            with rep.lock:
                try:
                    finished = rep.engine.step()
                except Exception as e:  # noqa: BLE001 - keep serving; fail what was in flight
                    log.exception("engine step failed")
                    self._fail_all(rep, f"engine step failed: {e}")
                    continue
                self._note_scheduled(rep, finished)
                self._publish(rep, finished)
                self._release_siblings(rep)

    def _release_siblings(self, rep: ReplicaState) -> None:
        """Queue the deferred samples of every first sample that has computed its prompt."""
        engine = rep.engine
        for first in list(rep.deferred):
            state = engine.stream(first)
            if state is None or state.num_generated > 0:
                for rid, checked in rep.deferred.pop(first):
                    try:
                        engine.add_request(checked, checked.params, rid)
                    except Exception as e:  # noqa: BLE001 - validated at submit; defensive
                        self._fail_one(rep, rid, f"{type(e).__name__}: {e}")

    def _finished(self, out: CompletionOutput) -> None:
        """`on_finish(out)`; a failing callback (metrics) is logged, never raised."""
        if self._on_finish is None:
            return
        try:
            self._on_finish(out)
        except Exception:  # noqa: BLE001 - one request's bookkeeping must not stop the loop
            log.exception("on_finish failed for request %s", out.request_id)

    def _note_scheduled(self, rep: ReplicaState, finished: list[CompletionOutput]) -> None:
        """Report the queue time of the samples the step just run scheduled first."""
        if not rep.unscheduled:
            return
        now = time.perf_counter()
        done = {out.request_id for out in finished}
        for rid, sub in list(rep.unscheduled.items()):
            req = rep.engine.scheduler.get_request(rid)
            if rid in done or (req is not None and getattr(req, "admitted_once", True)):
                del rep.unscheduled[rid]
                if self._on_scheduled is not None:
                    try:
                        self._on_scheduled(now - sub.submitted)
                    except Exception:  # noqa: BLE001 - metrics must not stop the loop
                        log.exception("on_scheduled failed for request %s", rid)

    def _publish(self, rep: ReplicaState, finished: list[CompletionOutput]) -> None:
        engine = rep.engine
        for rid, sub in list(rep.subs.items()):
            try:
                state = engine.stream(rid, sub.sent)
                if state is None or not state.token_ids:  # finished (below), deferred, no news
                    continue
                sub.push(("delta", state.token_ids, state.logprobs, state.top_logprobs))
                sub.sent = state.num_generated
            except Exception as e:  # noqa: BLE001 - fail this request, keep the others
                log.exception("publishing request %s failed", rid)
                self._fail_one(rep, rid, f"{type(e).__name__}: {e}")
        for out in finished:
            self._finished(out)
            waiting = self._detach(rep, out.request_id)
            if waiting is None:
                continue
            try:
                tail = out.token_ids[waiting.sent :]
                if tail:
                    waiting.push(
                        (
                            "delta",
                            list(tail),
                            (out.logprobs or [])[waiting.sent :],
                            (out.top_logprobs or [])[waiting.sent :],
                        )
                    )
                waiting.push(("done", out))
            except Exception:  # noqa: BLE001 - e.g. its event loop is gone
                log.exception("delivering request %s failed", out.request_id)

    def _fail_one(self, rep: ReplicaState, rid: str, message: str) -> None:
        """Abort one request (lock held) and send its subscriber a "failed" event."""
        sub = self._detach(rep, rid)
        self._engine_abort(rep, rid)
        if sub is not None:
            with contextlib.suppress(Exception):  # its event loop may be gone
                sub.push(("failed", message))

    def _fail_all(self, rep: ReplicaState, message: str) -> None:
        for rid, sub in list(rep.subs.items()):
            self._engine_abort(rep, rid)
            self._owner.pop(rid, None)
            with contextlib.suppress(Exception):
                sub.push(("error", message))
        rep.subs.clear()
        rep.unscheduled.clear()
        rep.deferred.clear()
