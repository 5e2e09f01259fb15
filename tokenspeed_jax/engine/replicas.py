"""Data-parallel replicas: one driver that routes requests over independent engines, steps the
busy ones concurrently and merges their stats (`LLM.generate`, `run_workload` and the server's
`AsyncEngine` all route through `Replicas`).

Routing policies (`ROUTES`), an explicit choice of each entry point:
  - "prefix" (`pick_replica`): the replica whose prefix cache holds the longest prefix of the
    prompt wins (its pages are reused instead of recomputed); ties go to the least loaded replica
    (running + waiting requests, plus any the caller holds back for it), then the lowest index.
    The default of `run_workload` and the server (multi-turn sessions revisit their prefix).
  - "load": the replica with the fewest outstanding tokens (prompt + max_tokens of its live
    requests, `Engine.outstanding_tokens`, plus any the caller holds back for it); ties go to the
    lowest index. The default of `LLM.generate` (one batch, balanced by work).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from tokenspeed_jax.engine.engine import Engine
from tokenspeed_jax.engine.tracks import CheckedPrompt
from tokenspeed_jax.outputs import CompletionOutput
from tokenspeed_jax.sampling_params import SamplingParams

ROUTES = ("prefix", "load")


def pick_replica(
    engines: Sequence[Engine], prompt: list[int], extra_load: Callable[[int], int] | None = None
) -> int:
    """Index of the replica that should serve `prompt` under the "prefix" policy (callers hold
    whatever locks the engines need; `Scheduler.prefix_match_tokens` is read-only)."""
    if len(engines) == 1:
        return 0
    best, best_key = 0, None
    for i, e in enumerate(engines):
        load = e.scheduler.num_unfinished + (extra_load(i) if extra_load else 0)
        key = (-e.scheduler.prefix_match_tokens(prompt), load, i)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def aggregate_stats(per: list[dict]) -> dict:
    """One replica: its stats as they are. Several: the sum of their numeric counters (and
    per-group page dicts), prefix_hit_rate recomputed from the summed tokens, and the
    per-replica dicts under "replicas"; see `LLM.stats`."""
    if len(per) == 1:
        return per[0]
    out = dict(per[0])
    for key, val in per[0].items():
        if isinstance(val, bool):
            continue
        if isinstance(val, (int, float)):
            out[key] = sum(s[key] for s in per)
        elif isinstance(val, dict) and all(isinstance(v, (int, float)) for v in val.values()):
            out[key] = {k: sum(s[key][k] for s in per) for k in val}
    q = out.get("prefix_query_tokens", 0)
    out["prefix_hit_rate"] = out.get("prefix_hit_tokens", 0) / q if q else 0.0
    out["replicas"] = per
    return out


class Replicas:
    """Route, submit, step and summarise over data-parallel engines (one model, one cache each).

    route: the default policy of `route` / `submit`, "prefix" or "load" (module docstring).
    Not thread-safe: a caller that steps replicas from several threads (`AsyncEngine`) holds the
    engines' locks around `route` and steps each engine itself."""

    def __init__(self, engines: Engine | Sequence[Engine], route: str = "prefix") -> None:
        self.engines: list[Engine] = [engines] if isinstance(engines, Engine) else list(engines)
        if not self.engines:
            raise ValueError("Replicas needs at least one engine")
        self.policy = self._policy(route)
        self._pool: ThreadPoolExecutor | None = None
        self._ids = itertools.count()

    def new_request_id(self) -> str:
        """A request id no replica has used: each engine numbers its own requests, so ids made
        by two engines collide, and whoever maps ids to replicas (the server) must not see that."""
        return f"req-{next(self._ids)}"

    @staticmethod
    def _policy(route: str) -> str:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        return route

    def route(
        self,
        prompt: Sequence[int],
        *,
        held: Callable[[int], Sequence[int]] | None = None,
        route: str | None = None,
    ) -> int:
        """Index of the replica that should serve `prompt`.

        held(i): the outstanding tokens (prompt + max_tokens) of each request bound for replica
        i that its engine does not hold yet (the server's deferred samples); "prefix" counts
        them as requests, "load" adds their tokens. route: None = this object's policy."""
        policy = self.policy if route is None else self._policy(route)
        if len(self.engines) == 1:
            return 0
        if policy == "prefix":
            ids = prompt if isinstance(prompt, list) else list(prompt)
            return pick_replica(self.engines, ids, None if held is None else lambda i: len(held(i)))
        return min(
            range(len(self.engines)),
            key=lambda i: self.engines[i].outstanding_tokens + (sum(held(i)) if held is not None else 0),
        )

    def submit(
        self,
        prompt: Sequence[int] | CheckedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        route: str | None = None,
    ) -> tuple[int, str]:
        """Route one request and queue it (`Engine.add_request`: token ids, or a `CheckedPrompt`
        from `Engine.validate`); returns (replica index, request id). ValueError on bad input."""
        ids = prompt.ids if isinstance(prompt, CheckedPrompt) else prompt
        i = self.route(ids, route=route)
        rid = request_id if request_id is not None else self.new_request_id()
        return i, self.engines[i].add_request(prompt, params, rid)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def step_busy(self) -> list[CompletionOutput]:
        """One step of every replica that has unfinished requests, concurrently when there are
        several (JAX releases the GIL while a replica's step runs on its devices); the outputs
        that finished, in replica order. Nothing busy: []."""
        busy = [e for e in self.engines if e.has_unfinished()]
        if not busy:
            return []
        if len(busy) == 1:
            return busy[0].step()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(self.engines), thread_name_prefix="dp-replica")
        return [out for outs in self._pool.map(lambda e: e.step(), busy) for out in outs]

    def drain_idle(self) -> None:
        """Overlapped loop: collect the last step planned behind a stop on every replica with
        nothing unfinished (its results reach no request; afterwards `stats` is exact)."""
        for e in self.engines:
            if not e.has_unfinished():
                e.drain()

    def stats(self) -> dict:
        """`aggregate_stats` of every replica's `Engine.stats()`."""
        return aggregate_stats([e.stats() for e in self.engines])

    def close(self) -> None:
        """Stop the stepping threads (a later `step_busy` starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
