"""The host KV tier's scheduler side (issue 49): literal page ids of evict -> save -> hit ->
load back, the host pool's LRU, exclusivity of the tiers, and the copy columns' padding.
(Random workloads with the tier: `test_scheduler_stateful.py`; the device side:
tests/tokenspeed_jax/test_host_tier.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import Scheduler, SchedulerConfig
from scheduler.host_tier import HostPagePool, copy_bucket


def _cfg(**kw) -> SchedulerConfig:
    base = dict(num_pages=5, page_size=4, max_batch_requests=2, max_context_len=16, host_pages=3)
    return SchedulerConfig(**{**base, **kw, "debug_checks": True})


def _run(sched: Scheduler, rid: str, prompt: list[int], max_new: int = 1) -> list[tuple]:
    """Run one request alone to the end; the copies of each step as (saves, save slots, loads,
    load pages) over the valid entries."""
    sched.add_request(rid, prompt, max_new_tokens=max_new)
    seen = []
    while sched.has_unfinished():
        ops = sched.schedule()
        c = ops.copies
        if c is not None:
            seen.append(
                (
                    c.save_pages[: c.num_saves].tolist(),
                    c.save_slots[: c.num_saves].tolist(),
                    c.load_slots[: c.num_loads].tolist(),
                    c.load_pages[: c.num_loads].tolist(),
                )
            )
            # padding: the drop sentinels, C a copy bucket
            assert c.width == copy_bucket(max(c.num_saves, c.num_loads))
            assert (c.save_pages[c.num_saves :] == sched.config.num_pages).all()
            assert (c.load_slots[c.num_loads :] == sched.config.host_pages).all()
        sched.update(ops, np.full(sched.config.max_batch_requests, 7, np.int32))
    return seen


A = list(range(100, 109))  # 9 tokens: pages 1, 2 full (published), page 3 holds token 8
B = list(range(200, 213))  # 13 tokens: 4 pages, the whole 4-page pool


def test_evict_save_hit_load_literal_pages():
    sched = Scheduler(_cfg())
    host = sched.host_tier.pool
    assert _run(sched, "a", A) == []  # a fresh pool: nothing evicted
    assert sched.pool.free_page_ids() == [4, 3, 2, 1]  # freed deepest first
    # b takes the whole pool: pages 2 and 1 carried a's two published pages -> host pages 0, 1
    assert _run(sched, "b", B) == [([2, 1], [0, 1], [], [])]
    assert host.lru_pages() == [0, 1] and sched.pool.lookup((0, b"")) is None
    # a again: its 8-token prefix is on the host (page 1 on host page 1, page 2 on host page 0),
    # loaded into the free pages 1 and 2; page 2 carried b's third page (saved to host page 0,
    # freed by the load) and page 3 its second (host page 1): the tiers swap
    assert _run(sched, "c", A) == [([2, 3], [0, 1], [1, 0], [1, 2])]
    st = sched.stats()
    assert st["prefix_hit_tokens"] == 8 and st["host_hit_tokens"] == 8
    assert st["host_pages_saved"] == 4 and st["host_pages_loaded"] == 2
    assert st["free_pages"] == st["total_pages"]
    sched.check_invariants()


def test_without_the_tier_the_same_run_recomputes():
    sched = Scheduler(_cfg(host_pages=0))
    for rid, prompt in (("a", A), ("b", B), ("c", A)):
        _run(sched, rid, prompt)
    assert sched.stats()["prefix_hit_tokens"] == 0 and "host_pages_saved" not in sched.stats()


def test_recomputing_a_host_key_drops_the_host_copy():
    """Tiers are exclusive: a key published on the device leaves the host index."""
    sched = Scheduler(_cfg(enable_adoption=False))
    _run(sched, "a", A)
    _run(sched, "b", B)
    key = sched.host_tier.pool.key_of(1)  # a's first page, on host page 1
    assert key is not None
    sched.add_request("c", A, max_new_tokens=1)
    sched.host_tier.drop_cached()  # c cannot hit: it recomputes a's pages
    while sched.has_unfinished():
        sched.update(sched.schedule(), np.full(2, 7, np.int32))
    assert sched.pool.has_key(key) and sched.host_tier.pool.lookup(key) is None


def test_host_pool_lru_take_and_invariants():
    pool = HostPagePool(2)
    assert pool.store("k0") == 0 and pool.store("k1") == 1
    assert pool.store("k2") == 0 and pool.num_evictions == 1  # the oldest went
    assert pool.lookup("k0") is None and pool.lookup("k2") == 0 and pool.lru_pages() == [1, 0]
    assert pool.take(1) == "k1" and pool.lru_pages() == [0]
    assert pool.store("k3") == 1  # the emptied page first, no eviction
    assert pool.num_evictions == 1
    pool.check_invariants()
    with pytest.raises(RuntimeError, match="already"):
        pool.store("k3")
    assert pool.take(0) == "k2"
    with pytest.raises(RuntimeError, match="empty"):
        pool.take(0)
    assert pool.drop_cached() == 1 and pool.lookup("k3") is None
    pool.check_invariants()


def test_more_saves_than_host_pages_in_one_step():
    """One step evicting more hashed pages than the host holds: the last ones are kept, each on
    its own host page."""
    sched = Scheduler(_cfg(num_pages=9, max_context_len=32, host_pages=2))
    _run(sched, "a", list(range(100, 129)))  # 29 tokens: 7 published pages
    seen = _run(sched, "b", list(range(300, 332))[:29])
    saves = [s for s in seen if s[0]]
    assert len(saves) == 1 and len(saves[0][0]) == 2 and sorted(saves[0][1]) == [0, 1]
    sched.check_invariants()


def test_bad_host_pages():
    with pytest.raises(ValueError, match="host_pages"):
        SchedulerConfig(num_pages=8, host_pages=-1)
    with pytest.raises(ValueError, match="host tier"):
        HostPagePool(0)


def test_reset_prefix_cache_drops_the_host_tier_too():
    sched = Scheduler(_cfg())
    _run(sched, "a", A)
    _run(sched, "b", B)
    assert sched.host_tier.pool.num_cached == 2
    assert sched.reset_prefix_cache() >= 2
    assert sched.host_tier.pool.num_cached == 0
    assert _run(sched, "c", A) == [] and sched.stats()["host_hit_tokens"] == 0


def test_a_key_two_device_pages_carried_is_saved_once():
    """Without adoption two requests computing the same prompt publish duplicate pages; one step
    evicting all of them saves each key once."""
    sched = Scheduler(_cfg(num_pages=9, max_context_len=32, host_pages=4, enable_adoption=False))
    sched.add_request("x", A, max_new_tokens=1)
    sched.add_request("y", A, max_new_tokens=1)
    while sched.has_unfinished():
        sched.update(sched.schedule(), np.full(2, 7, np.int32))
    assert len([p for p in range(1, 9) if sched.pool.key_of(p) is not None]) == 4  # 2 keys x 2
    seen = _run(sched, "b", list(range(300, 329)))  # 29 tokens: the whole 8-page pool
    assert [len(s[0]) for s in seen if s[0]] == [2]
    assert sched.host_tier.pool.num_cached == 2
    sched.check_invariants()
