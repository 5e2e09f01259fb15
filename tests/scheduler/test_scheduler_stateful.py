"""Hypothesis stateful test of the Scheduler over random workloads.

Arrivals with shared prefixes, aborts, a tiny pool that forces retraction, hybrid full + sliding +
live-tail conv groups. `debug_checks=True` makes every schedule() apply the StepOps to a numpy
mirror (DESIGN §6 rules) and assert it equals the authoritative rows, and run check_invariants()
after every schedule and update. On top: StepOps shapes never change, each request finishes with
its exact token count, and all pages come back at the end.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler import Scheduler, SchedulerConfig, group_specs_from_layer_types

STOP = 7
SPECS = group_specs_from_layer_types(
    layer_types=["conv", "full_attention", "sliding_attention"], sliding_window_tokens=6,
    page_size=4, conv_kernel_size=3, conv_page_size=2)


def _shapes(ops):
    out = [ops.req_slots.shape, ops.cu_q_lens.shape, ops.token_ids.shape, ops.seeds.shape]
    for g in ops.groups:
        out += [g.new_pages.shape, g.rows.shape, g.hole_slots.shape]
    return out


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = SchedulerConfig(num_pages=40, page_size=4, max_batch_requests=4,
                                   max_scheduled_tokens=12, max_context_len=48, groups=SPECS,
                                   debug_checks=True)
        self.sched = Scheduler(self.cfg)
        self.rng = np.random.default_rng(0)
        self.expect: dict[str, tuple[int, bool]] = {}  # id -> (max_new, stop allowed)
        self.finished: dict[str, object] = {}
        self.shapes = None
        self.n = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4, 5, 6, 1, 2], [9] * 12, [9] * 13]),
          own=st.lists(st.integers(0, 12), min_size=0, max_size=14),
          max_new=st.integers(1, 16), stop=st.booleans())
    def add(self, prefix, own, max_new, stop):
        prompt = prefix + own
        rid = f"r{self.n:03d}"
        self.n += 1
        before = self.sched.stats()
        if not prompt or len(prompt) + max_new > self.cfg.max_context_len:
            with pytest.raises(ValueError):
                self.sched.add_request(rid, prompt, max_new)
            after = self.sched.stats()
            assert after["num_waiting"] == before["num_waiting"]
            return
        self.sched.add_request(rid, prompt, max_new, stop_token_ids=[STOP] if stop else [])
        self.expect[rid] = (max_new, stop)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(positional=st.booleans())
    def step(self, positional=False):
        ops = self.sched.schedule()
        shapes = _shapes(ops)
        if self.shapes is None:
            self.shapes = shapes
        assert shapes == self.shapes
        assert ops.num_tokens <= self.cfg.max_scheduled_tokens
        if positional:
            # a token that depends only on the position: requests with equal prompts generate
            # equal pages, so pages completed during decode get adopted (non-tail repoints)
            sampled = ((ops.kv_lens * 5 + 3) % 12).astype(np.int32)
        else:
            sampled = self.rng.integers(0, 12, size=self.cfg.max_batch_requests).astype(np.int32)
        for out in self.sched.update(ops, sampled):
            self._check_finished(out)

    @precondition(lambda self: self.expect)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.expect)))
        self.sched.abort(rid)
        del self.expect[rid]

    def _check_finished(self, out):
        max_new, stop = self.expect.pop(out.request_id)
        if out.finish_reason == "stop":
            assert stop and out.token_ids[-1] == STOP and len(out.token_ids) <= max_new
            assert STOP not in out.token_ids[:-1]
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == max_new
            assert not stop or STOP not in out.token_ids

    def teardown(self):
        # drain: everything finishes (nobody starves), and every page comes back
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished() and not self.expect
        stats = self.sched.stats()
        assert stats["free_pages"] == stats["total_pages"] and stats["reserved_pages"] == 0

    @invariant()
    def consistent(self):
        self.sched.check_invariants()


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("chunk_cap", [None, 5])
def test_pressure_workload_retracts_and_completes(chunk_cap):
    """A deterministic heavy run: the pool is far too small for everyone at once."""
    cfg = SchedulerConfig(num_pages=30, page_size=4, max_batch_requests=8, max_scheduled_tokens=16,
                          max_context_len=48, groups=SPECS, debug_checks=True,
                          max_prefill_chunk_tokens=chunk_cap)
    sched = Scheduler(cfg)
    rng = np.random.default_rng(1)
    for i in range(12):
        sched.add_request(f"q{i}", [1, 2, 3, 4, 5, 6, 1, 2] + list(rng.integers(0, 50, 6)), 20)
    done = []
    while sched.has_unfinished():
        ops = sched.schedule()
        done += sched.update(ops, rng.integers(0, 50, 8).astype(np.int32))
    assert sorted(o.request_id for o in done) == sorted(f"q{i}" for i in range(12))
    assert all(len(o.token_ids) == 20 for o in done)
    stats = sched.stats()
    assert stats["num_retractions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert stats["free_pages"] == stats["total_pages"]


def test_adoption_during_decode_forces_full_refresh():
    """Two identical requests decode identical tokens; the later one's completed decode pages are
    adopted onto the earlier one's copies while it is in pure decode: its next op must refresh."""
    cfg = SchedulerConfig(num_pages=40, page_size=4, max_batch_requests=4, max_scheduled_tokens=16,
                          max_context_len=48, debug_checks=True)
    sched = Scheduler(cfg)
    sched.add_request("x", [1, 2, 3, 4, 5, 6], 20)
    sched.add_request("y", [1, 2, 3, 4, 5, 6], 20)
    refreshed_decodes = 0
    while sched.has_unfinished():
        ops = sched.schedule()
        y = ops.row_of("y") if "y" in ops.request_ids else None
        if y is not None and ops.kv_lens[y] > 12 and ops.full_refresh[y]:
            refreshed_decodes += 1
        sched.update(ops, ((ops.kv_lens * 5 + 3) % 12).astype(np.int32))
    stats = sched.stats()
    assert stats["adopted_pages"] >= 4  # 1 prompt page + decode pages
    assert refreshed_decodes >= 3  # one refresh after each decode-time adoption
