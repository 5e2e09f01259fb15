"""Hypothesis stateful test of the Scheduler over random workloads.

Arrivals with shared prefixes, aborts, a tiny pool that forces retraction, hybrid full + sliding +
live-tail conv groups, and a recurrent-state group beside full attention (every-page snapshots).
`debug_checks=True` makes every schedule() apply the StepOps to a numpy
mirror (DESIGN §6 rules) and assert it equals the authoritative rows, and run check_invariants()
after every schedule and update. On top: StepOps shapes never change, each request finishes with
its exact token count, and all pages come back at the end (the machine: tests/scheduler/helpers.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings

from scheduler import Scheduler, SchedulerConfig
from tests.scheduler.helpers import HYBRID, STATE_HYBRID, SchedulerMachine

TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


class StateSchedulerMachine(SchedulerMachine):
    """The same workloads over a recurrent-state group publishing every page."""

    GROUPS = STATE_HYBRID
    STATE_SNAPSHOTS = "every_page"


TestStateScheduler = StateSchedulerMachine.TestCase
TestStateScheduler.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)


class StatePoolMachine(StateSchedulerMachine):
    """The state group on a pool of its own, small enough that state pages run short first."""

    STATE_PAGES = 10


TestStatePool = StatePoolMachine.TestCase
TestStatePool.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)


class HostTierSchedulerMachine(SchedulerMachine):
    """The same workloads with a host KV tier (issue 49) under a smaller pool, so pages are
    evicted, saved, hit on the host and loaded back; a 5-page host tier also evicts its own."""

    NUM_PAGES = 30
    HOST_PAGES = 5


TestHostTierScheduler = HostTierSchedulerMachine.TestCase
TestHostTierScheduler.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)


class HostTierStateMachine(StateSchedulerMachine):
    """Recurrent-state snapshots go to the host tier and come back too."""

    NUM_PAGES = 30
    HOST_PAGES = 8


TestHostTierState = HostTierStateMachine.TestCase
TestHostTierState.settings = settings(max_examples=20, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("chunk_cap", [None, 5])
@pytest.mark.parametrize(
    "groups, host_pages",
    # a host tier needs one pool, so the state pool runs without one
    [("hybrid", 0), ("hybrid", 6), ("state", 0), ("state", 6), ("state_pool", 0)],
)
def test_pressure_workload_retracts_and_completes(chunk_cap, groups, host_pages):
    """A deterministic heavy run: the pool is far too small for everyone at once (with a state
    pool of its own, both pools are: 30 pages and 9 state pages)."""
    state = groups != "hybrid"
    cfg = SchedulerConfig(
        num_pages=30,
        page_size=4,
        max_batch_requests=8,
        max_scheduled_tokens=16,
        max_context_len=48,
        groups=STATE_HYBRID if state else HYBRID,
        debug_checks=True,
        max_prefill_chunk_tokens=chunk_cap,
        state_snapshots="every_page" if state else "chunk_end",
        host_pages=host_pages,
        state_pages=10 if groups == "state_pool" else None,
    )
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
    if groups == "state_pool":
        assert stats["state_free_pages"] == stats["state_total_pages"] == 9
        assert stats["state_evictions"] > 0  # the state pool ran short on its own
    if host_pages:  # retracted requests' pages went to the host tier and came back
        assert stats["host_pages_saved"] > 0 and stats["host_pages_loaded"] > 0


def test_adoption_during_decode_forces_full_refresh():
    """Two identical requests decode identical tokens; the later one's completed decode pages are
    adopted onto the earlier one's copies while it is in pure decode: its next op must refresh."""
    cfg = SchedulerConfig(
        num_pages=40,
        page_size=4,
        max_batch_requests=4,
        max_scheduled_tokens=16,
        max_context_len=48,
        debug_checks=True,
    )
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
