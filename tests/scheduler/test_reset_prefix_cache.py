"""`Scheduler.reset_prefix_cache` (issue 48: new weights make the cached K/V stale): every page
hash goes, pages stay free, a repeated prompt hits nothing afterwards; refused while a request
is unfinished."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import BlockPool, Scheduler, SchedulerConfig


def _run(sched: Scheduler, rid: str, prompt: list[int]) -> None:
    sched.add_request(rid, prompt, max_new_tokens=2)
    while sched.has_unfinished():
        ops = sched.schedule()
        sched.update(ops, np.full(sched.config.max_batch_requests, 7, np.int32))


def test_reset_drops_every_hash_and_keeps_pages_free():
    sched = Scheduler(SchedulerConfig(num_pages=32, page_size=4, max_batch_requests=4, max_context_len=64))
    prompt = list(range(1, 22))
    _run(sched, "a", prompt)
    _run(sched, "b", prompt)
    hits = sched.stats()["prefix_hit_tokens"]
    assert hits > 0
    assert sched.reset_prefix_cache() > 0
    st = sched.stats()
    assert st["free_pages"] == st["total_pages"]
    sched.pool.check_invariants()
    _run(sched, "c", prompt)
    assert sched.stats()["prefix_hit_tokens"] == hits  # nothing left to hit
    assert sched.reset_prefix_cache() > 0  # c's pages were published again


def test_reset_refused_while_busy():
    sched = Scheduler(SchedulerConfig(num_pages=32, page_size=4, max_batch_requests=4, max_context_len=64))
    sched.add_request("a", list(range(1, 10)), max_new_tokens=4)
    with pytest.raises(RuntimeError, match="idle"):
        sched.reset_prefix_cache()


def test_pool_drop_cached():
    pool = BlockPool(8)
    pages = pool.allocate(3)
    for i, p in enumerate(pages):
        pool.register(p, (0, i))
    pool.free(pages[:2])
    assert pool.drop_cached() == 3
    assert all(pool.key_of(p) is None for p in pages) and pool.lookup((0, 0)) is None
    pool.check_invariants()
