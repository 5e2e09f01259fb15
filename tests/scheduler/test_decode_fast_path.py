"""The scheduler's decode fast path (`Scheduler.decode_fast_path`: per-request plain decode rows
and the vectorised `OpsBuilder.build_decode`) against the general path, step by step.

Two schedulers get the same request stream and the same fake device (tests/scheduler/
helpers.py); one runs with the fast path off, so every row goes through reclaim ->
acquire -> `ScheduledRow` -> `OpsBuilder.build`. Every StepOps of the two runs must be equal in
every field and every array (and so must the outputs), in the synchronous and the overlapped
loop, under retraction, chunked prefill, prefix hits, hybrid groups with sliding-window holes,
aborts, and requests with penalties / logit_bias / top_logprobs / sampling parameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Scheduler, SchedulerConfig, StepOps
from scheduler.ops_builder import OpsBuilder
from tests.scheduler.helpers import HYBRID, STOP, VOCAB, FakeDevice, full_group, small_config


def _requests(seed: int, n: int) -> list[tuple[str, list[int], int, dict]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(4, VOCAB, 9).tolist()
    out = []
    for i in range(n):
        own = rng.integers(4, VOCAB, int(rng.integers(1, 12))).tolist()
        opts: dict = {"stop_token_ids": [STOP] if i % 2 else []}
        kind = i % 4
        if kind == 1:
            opts.update(temperature=0.7, top_p=0.9, top_k=5, seed=int(rng.integers(0, 2**32)))
        elif kind == 2:
            opts.update(presence_penalty=0.5, logit_bias={5: 1.5, 7: -2.0}, top_logprobs=3)
        elif kind == 3:
            opts.update(repetition_penalty=1.2, temperature=1.3)
        out.append((f"r{i}", (system if i % 3 else system[:5]) + own, int(rng.integers(1, 30)), opts))
    return out


def _assert_same(a: StepOps, b: StepOps, where: str) -> None:
    for f in dataclasses.fields(StepOps):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "groups":
            for g, (ga, gb) in enumerate(zip(x, y, strict=True)):
                for gf in dataclasses.fields(ga):
                    u, v = getattr(ga, gf.name), getattr(gb, gf.name)
                    assert u.dtype == v.dtype and np.array_equal(u, v), f"{where}: group {g} {gf.name}"
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f"{where}: {f.name}\n{x}\n{y}"
        else:
            assert x == y, f"{where}: {f.name}"


def _run_pair(
    cfg: SchedulerConfig, seed: int, n: int, overlapped: bool, abort_at: dict[int, str] | None = None
) -> tuple[int, int]:
    """Run both schedulers in lockstep; returns (steps, steps built by build_decode)."""
    scheds = [Scheduler(cfg), Scheduler(cfg)]
    scheds[1].decode_fast_path = False
    devs = [FakeDevice(cfg, full_group(cfg)) for _ in scheds]
    for s in scheds:
        for rid, prompt, max_new, opts in _requests(seed, n):
            s.add_request(rid, prompt, max_new, **opts)
    counts = [0]
    real = scheds[0]._builder.build_decode

    def counted(*a, **k):
        counts[0] += 1
        return real(*a, **k)

    scheds[0]._builder.build_decode = counted  # type: ignore[method-assign]
    prev: list = [None, None]
    outs: list[dict] = [{}, {}]
    applied: list[list[bool]] = [[], []]  # the rows of each scheduler's latest update
    step = 0
    while any(s.has_unfinished() for s in scheds) or prev[0] is not None:
        ops = [s.schedule() for s in scheds]
        _assert_same(ops[0], ops[1], f"seed {seed} step {step}")
        for k, (s, dev) in enumerate(zip(scheds, devs)):
            cur = (ops[k], dev.run(ops[k])) if ops[k].num_reqs else None
            if overlapped:
                done, prev[k] = prev[k], cur
            else:
                done = cur
            if done is not None:
                update = s.update_step(*done)
                applied[k] = update.applied
                for o in update.finished:
                    outs[k][o.request_id] = o
        assert applied[0] == applied[1]
        step += 1
        if abort_at and step in abort_at:
            for s in scheds:
                s.abort(abort_at[step])
        assert step < 2000, "no progress"
    assert outs[0] == outs[1]
    assert scheds[0].stats() == scheds[1].stats()
    return step, counts[0]


CONFIGS = {
    "roomy": lambda: small_config(num_pages=120, max_batch_requests=6),
    "tight": lambda: small_config(num_pages=24),
    "chunked": lambda: small_config(num_pages=60, max_prefill_chunk_tokens=5),
    "hybrid": lambda: small_config(num_pages=50, groups=HYBRID),
}


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_fast_path_equals_general_path(kind, overlapped):
    used = 0
    for seed in range(3):
        _, fast_steps = _run_pair(
            CONFIGS[kind](), seed, 10, overlapped, abort_at={6: "r2", 11: "r5"} if seed == 1 else None
        )
        used += fast_steps
    assert used > 0, "build_decode never ran: the comparison would be vacuous"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(sorted(CONFIGS)),
    overlapped=st.booleans(),
    n=st.integers(1, 14),
)
def test_fast_path_equals_general_path_random(seed, kind, overlapped, n):
    _run_pair(CONFIGS[kind](), seed, n, overlapped)


def test_build_decode_equals_build_directly():
    """The vectorised builder alone, on the ScheduledRows the general path would pass."""
    cfg = small_config(num_pages=120, max_batch_requests=6, max_context_len=128, debug_checks=False)
    sched = Scheduler(cfg)
    for rid, prompt, max_new, opts in _requests(4, 6):
        sched.add_request(rid, prompt, max_new + 20, **opts)
    dev = FakeDevice(cfg, full_group(cfg))
    while any(not r.prefill_done or not r.num_decode_rows for r in sched._running) or sched._waiting:
        ops = sched.schedule()
        sched.update(ops, dev.run(ops))
    builder = OpsBuilder(cfg)
    for r in sched._running:
        builder.bind(r)
    from scheduler.ops_builder import ScheduledRow

    reqs = list(sched._running)
    rows = [
        ScheduledRow(
            req=r,
            start=r.num_scheduled,
            num_tokens=1,
            full_refresh=False,
            samples=True,
            begins=None,
            sizes=[0] * len(cfg.groups),
            holes=[[] for _ in cfg.groups],
            plain=True,
        )
        for r in reqs
    ]
    fast = builder.build_decode(
        reqs,
        [r.slot for r in reqs],
        [r.num_scheduled for r in reqs],
        [r.tokens[-1] for r in reqs],
        any(r.sampling.needs_extras for r in reqs),
        [],
    )
    _assert_same(fast, builder.build(rows), "direct")
