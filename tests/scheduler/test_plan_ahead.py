"""Overlapped scheduling (plan one step ahead) against the synchronous loop, on a fake device.

The fake device (tests/scheduler/helpers.py) is a faithful numpy model of what the runtime does
with a StepOps: a wrong page table, a page freed and reused too early, a wrong placeholder or a
stale slot all change the context it reads, so the tokens diverge from the synchronous loop.

Checked: every request's tokens and finish reason equal the synchronous loop's (stop tokens,
max_tokens, chunked prefill, prefix hits + adoption, forced retraction), no placeholder reaches
an output, no extra token is ever returned, the debug mirror/invariant checks pass at every
schedule and update, no page leaks, and aborts of requests with a row in flight are exact.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import precondition, rule

from scheduler import PLACEHOLDER_TOKEN, Scheduler, SchedulerConfig
from tests.scheduler.helpers import (
    HYBRID,
    STOP,
    VOCAB,
    FakeDevice,
    SchedulerMachine,
    full_group,
    small_config,
)


def _workload(sched: Scheduler, seed: int, n: int = 10) -> None:
    rng = np.random.default_rng(seed)
    system = rng.integers(4, VOCAB, 9).tolist()
    for i in range(n):
        own = rng.integers(4, VOCAB, int(rng.integers(1, 12))).tolist()
        prompt = (system if i % 3 else system[:5]) + own
        sched.add_request(f"r{i}", prompt, int(rng.integers(1, 30)), stop_token_ids=[STOP] if i % 2 else [])


def run_sync(cfg: SchedulerConfig, seed: int):
    sched, dev = Scheduler(cfg), FakeDevice(cfg, full_group(cfg))
    _workload(sched, seed)
    outs, rows = {}, 0
    while sched.has_unfinished():
        ops = sched.schedule()
        rows += int(ops.sample_mask.sum())
        for o in sched.update(ops, dev.run(ops)):
            outs[o.request_id] = o
    return sched, outs, rows


def run_overlapped(cfg: SchedulerConfig, seed: int, abort_at: dict[int, str] | None = None):
    """Schedule step N+1 (and run it on the device) before step N's update, every step."""
    sched, dev = Scheduler(cfg), FakeDevice(cfg, full_group(cfg))
    _workload(sched, seed)
    outs, rows, step = {}, 0, 0
    prev = None
    while sched.has_unfinished() or prev is not None:
        ops = sched.schedule()
        assert sched.num_in_flight <= 2
        rows += int(ops.sample_mask.sum())
        cur = (ops, dev.run(ops)) if ops.num_seqs else None
        if prev is not None:
            for o in sched.update(*prev):
                assert o.request_id not in outs
                outs[o.request_id] = o
        prev = cur
        step += 1
        if abort_at and step in abort_at:
            sched.abort(abort_at[step])  # its row of the step in flight must be ignored
    return sched, outs, rows


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["roomy", "tight", "chunked", "hybrid"])
def test_overlapped_equals_synchronous(kind, seed):
    cfg = {
        "roomy": lambda: small_config(num_pages=120),
        "tight": lambda: small_config(num_pages=24),
        "chunked": lambda: small_config(num_pages=60, max_prefill_chunk_tokens=5),
        "hybrid": lambda: small_config(num_pages=50, groups=HYBRID),
    }[kind]()
    s_sync, sync, sync_rows = run_sync(cfg, seed)
    s_async, ovl, ovl_rows = run_overlapped(cfg, seed)
    assert sorted(ovl) == sorted(sync)
    for rid, o in sync.items():
        assert ovl[rid].token_ids == o.token_ids, rid
        assert ovl[rid].finish_reason == o.finish_reason, rid
        assert PLACEHOLDER_TOKEN not in ovl[rid].token_ids
    stats = s_async.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["reserved_pages"] == 0
    assert s_async.num_in_flight == 0
    # extra rows are only the ones planned behind a stop token (never behind a length limit)
    stops = sum(o.finish_reason == "stop" for o in sync.values())
    assert stats["num_dropped_tokens"] <= stops
    generated = sum(len(o.token_ids) for o in sync.values())
    assert sync_rows == generated  # every sampling row's token is output ...
    assert ovl_rows == generated + stats["num_dropped_tokens"]  # ... or counted as dropped
    if kind == "tight":
        assert stats["num_retractions"] > 0
    # When the next step is planned, the pages the step in flight completes are published and
    # slid-out sliding-window / conv slots are reclaimed at the scheduled extent, as the
    # synchronous loop's update + schedule would have: the overlapped loop holds no more pages
    # and retracts no more often ...
    sync_stats = s_sync.stats()
    assert s_async.pool.peak_used <= s_sync.pool.peak_used
    assert stats["num_retractions"] <= sync_stats["num_retractions"]
    # ... and its prefix hits are the same. (Not asserted on the hybrid pool, which evicts 120+
    # pages: there a stop-token finish, which frees its pages a step later than in the
    # synchronous loop, changes which cached pages are evicted.)
    if kind != "hybrid":
        assert stats["prefix_hit_tokens"] == sync_stats["prefix_hit_tokens"]
    if kind == "roomy":
        assert stats["prefix_hit_tokens"] > 0


def test_stop_token_row_in_flight_is_dropped_and_pages_freed_at_once():
    cfg = small_config(num_pages=20)
    sched = Scheduler(cfg)
    sched.add_request("a", [5, 6, 7, 8, 9], 10, stop_token_ids=[STOP])
    total = sched.stats()["total_pages"]
    s0 = sched.schedule()  # prefill, samples token 1
    s1 = sched.schedule()  # planned ahead: decode with a placeholder input
    assert s1.token_ids[0] == PLACEHOLDER_TOKEN and s1.token_from_prev[0]
    assert s1.sample_index[0] == 1 and s1.positions[0] == 5
    assert sched.update(s0, np.array([11, 0, 0, 0, 0], np.int32)) == []
    s2 = sched.schedule()
    out = sched.update(s1, np.array([STOP, 0, 0, 0, 0], np.int32))  # finishes in s1
    assert [(o.token_ids, o.finish_reason) for o in out] == [([11, STOP], "stop")]
    assert sched.stats()["free_pages"] == total  # freed now: any reuse runs after s2
    update = sched.update_step(s2, np.array([12, 0, 0, 0, 0], np.int32))
    assert update.finished == [] and update.applied == [False]  # dropped
    assert sched.stats()["num_dropped_tokens"] == 1


def test_length_limit_is_not_planned_ahead():
    sched = Scheduler(small_config())
    sched.add_request("a", [5, 6, 7], 2)
    s0 = sched.schedule()
    s1 = sched.schedule()  # decode of token 1 -> samples token 2 (the last)
    s2 = sched.schedule()  # token 2 ends it by length: nothing to plan
    assert s1.num_seqs == 1 and s2.num_seqs == 0
    sched.update(s0, np.full(5, 9, np.int32))
    out = sched.update(s1, np.full(5, 10, np.int32))
    assert out[0].token_ids == [9, 10] and out[0].finish_reason == "length"
    assert not sched.has_unfinished() and sched.num_in_flight == 0
    st = sched.stats()
    assert st["free_pages"] == st["total_pages"]


def test_length_finish_frees_slot_and_pages_when_the_next_step_is_planned():
    """One slot: `b` waits for `a`. `a`'s last token (max_new_tokens=1) is in flight when step 1
    is planned, so step 1 already releases `a` (publishing the prompt pages step 0 computes) and
    admits `b` into slot 0 with a prefix hit on them, as the synchronous loop would."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two full pages of 4, then one token
    for overlapped in (False, True):
        sched = Scheduler(small_config(max_batch_requests=1))
        sched.add_request("a", prompt, 1)
        sched.add_request("b", prompt[:8] + [20, 21], 2)
        s0 = sched.schedule()
        assert list(s0.req_slots[:1]) == [0] and tuple(s0.request_ids) == ("a",)
        if not overlapped:
            sched.update(s0, np.full(5, 30, np.int32))
        s1 = sched.schedule()
        assert tuple(s1.request_ids) == ("b",) and list(s1.req_slots[:1]) == [0]
        assert sched.get_request("b").num_cached_tokens == 8  # a's two published pages
        assert int(s1.num_tokens) == 2  # only b's own tokens are computed
        if overlapped:
            assert sched.get_request("a").tables is None  # released before its token landed
            update = sched.update_step(s0, np.full(5, 30, np.int32))
            assert [(o.request_id, o.token_ids, o.finish_reason) for o in update.finished] == [
                ("a", [30], "length")
            ]
            assert update.applied == [True]
        sched.update(s1, np.full(5, 31, np.int32))
        while sched.has_unfinished():
            ops = sched.schedule()
            sched.update(ops, np.full(5, 32, np.int32))
        st = sched.stats()
        assert st["free_pages"] == st["total_pages"] and st["num_dropped_tokens"] == 0


def test_abort_of_a_request_released_at_plan_time():
    sched = Scheduler(small_config())
    sched.add_request("a", [5, 6, 7], 1)
    s0 = sched.schedule()
    s1 = sched.schedule()  # releases a: its only token is in flight
    assert s1.num_seqs == 0 and sched.has_unfinished()
    sched.abort("a")
    assert sched.update(s0, np.full(5, 9, np.int32)) == []  # the token is dropped
    assert not sched.has_unfinished() and sched.stats()["num_dropped_tokens"] == 1
    sched.check_invariants()


def test_update_out_of_order_is_refused():
    sched = Scheduler(small_config())
    sched.add_request("a", [5, 6, 7], 4)
    s0 = sched.schedule()
    s1 = sched.schedule()
    with pytest.raises(ValueError, match="oldest scheduled"):
        sched.update(s1, np.zeros(5, np.int32))
    sched.update(s0, np.zeros(5, np.int32))
    sched.update(s1, np.zeros(5, np.int32))


@pytest.mark.parametrize("step", [1, 2, 3, 6])
def test_abort_in_flight_is_exact(step):
    cfg = small_config(num_pages=30)
    _, sync, _ = run_sync(cfg, 4)
    sched, ovl, _ = run_overlapped(cfg, 4, abort_at={step: "r1", step + 1: "r4"})
    stats = sched.stats()
    assert stats["free_pages"] == stats["total_pages"]
    assert stats["num_aborted"] == sum(r not in ovl for r in ("r1", "r4"))
    for rid, o in ovl.items():  # everyone else is unaffected
        assert o.token_ids == sync[rid].token_ids and o.finish_reason == sync[rid].finish_reason


def test_retracted_request_with_token_in_flight_keeps_it():
    """A tight pool retracts running requests while their decode row is in flight: the token
    it samples is still appended (it is real output), and the request resumes afterwards."""
    cfg = small_config(num_pages=14, max_batch_requests=4)
    sched, dev = Scheduler(cfg), FakeDevice(cfg, 0)
    for i in range(4):
        sched.add_request(f"r{i}", [10 + i] * 6, 12)
    prev, outs, retracted_pending = None, {}, 0
    while sched.has_unfinished() or prev is not None:
        ops = sched.schedule()
        retracted_pending += sum(1 for r in sched._waiting if r.num_pending)
        cur = (ops, dev.run(ops)) if ops.num_seqs else None
        if prev is not None:
            outs.update((o.request_id, o) for o in sched.update(*prev))
        prev = cur
    assert retracted_pending > 0, "the workload was meant to retract a request mid-flight"
    assert all(len(o.token_ids) == 12 for o in outs.values()) and len(outs) == 4
    stats = sched.stats()
    assert stats["free_pages"] == stats["total_pages"]


# ---------------------------------------------------------------- random workloads (hypothesis)
class OverlappedMachine(SchedulerMachine):
    """The scheduler stateful machine (arrivals with shared prefixes, aborts at any time, a pool
    that forces retraction, hybrid groups, debug mirror checks every schedule and update), driven
    by the overlapped loop: every step schedules N+1 before feeding back N."""

    def __init__(self) -> None:
        super().__init__()
        self.prev = None

    @precondition(lambda self: self.sched.has_unfinished() or self.prev is not None)
    @rule(positional=st.booleans())
    def step(self, positional=False):
        ops = self.sched.schedule()
        assert ops.num_tokens <= self.cfg.max_scheduled_tokens
        assert not np.any(
            ops.token_from_prev[: ops.num_tokens] != (ops.token_ids[: ops.num_tokens] == PLACEHOLDER_TOKEN)
        )
        if positional:
            sampled = ((ops.kv_lens * 5 + 3) % 12).astype(np.int32)
        else:
            sampled = self.rng.integers(0, 12, size=self.cfg.max_batch_requests).astype(np.int32)
        cur = (ops, sampled) if ops.num_seqs else None
        if self.prev is not None:
            for out in self.sched.update(*self.prev):
                assert PLACEHOLDER_TOKEN not in out.token_ids
                self.check_finished(out)
        self.prev = cur

    def teardown(self):
        for _ in range(2000):
            if not self.sched.has_unfinished() and self.prev is None:
                break
            self.step()
        assert not self.sched.has_unfinished() and not self.expect
        stats = self.sched.stats()
        assert stats["free_pages"] == stats["total_pages"] and stats["reserved_pages"] == 0


TestOverlapped = OverlappedMachine.TestCase
TestOverlapped.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
