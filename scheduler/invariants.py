"""Scheduler-wide consistency checks (run by debug mode and the hypothesis stateful tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.request import Status

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def check_scheduler_invariants(sched: Scheduler) -> None:
    """Raise AssertionError unless: every page's refcount equals the references the running
    requests' tables hold; no page is both free and referenced; free + referenced == num_pages - 1;
    page 0 is never free or cached; slots are unique and accounted for; reservations add up;
    waiting and finishing requests hold nothing."""
    refs: dict[int, int] = {}
    slots = set()
    reserved = 0
    for req in sched._running:
        assert req.status is Status.RUNNING and req.tables is not None
        assert req.slot not in slots, f"slot {req.slot} used twice"
        slots.add(req.slot)
        reserved += req.reserved
        for t in req.tables:
            for p in t.pages:
                if p:
                    refs[p] = refs.get(p, 0) + 1
    for req in sched._waiting:
        assert req.tables is None and req.slot == -1 and req.reserved == 0
    finishing = [r for r in sched._requests.values() if r.status is Status.FINISHING]
    for req in finishing:  # released at plan time: only its last token is still to come
        assert req.tables is None and req.slot == -1 and req.num_pending >= 1
    assert len(finishing) == sched._num_finishing, "finishing count drifted"
    assert reserved == sched._reserved_total, "reservation bookkeeping drifted"
    assert not slots & set(sched._free_slots), "a live slot is also free"
    assert len(slots) + len(sched._free_slots) == sched.config.num_live_slots
    sched.pool.check_invariants(refs)
