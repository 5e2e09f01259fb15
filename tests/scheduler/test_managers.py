"""Managers: every numeric case of DESIGN.md §3 with literal page ids and counts."""

from __future__ import annotations

import pytest

from scheduler import BlockPool, BlockTable, FullHistoryManager, SlidingWindowManager, StateManager


def _live(b=8, w=12, a=256):
    return SlidingWindowManager(b, w, live_tail_alignment=a)


def test_acquire_tail_arithmetic_full_history():
    m, pool, t = FullHistoryManager(4), BlockPool(20), BlockTable()
    assert m.acquire(pool, t, 5)
    assert t.page_ids() == [1, 2] and t.tail_avail == 3
    assert m.blocks_needed_for(t, 3) == 0
    assert m.acquire(pool, t, 3)
    assert t.page_ids() == [1, 2] and t.tail_avail == 0
    assert m.blocks_needed_for(t, 9) == 3
    assert m.acquire(pool, t, 9) and t.page_ids() == [1, 2, 3, 4, 5] and t.tail_avail == 3
    assert t.extent_tokens(4) == 17


def test_acquire_is_all_or_nothing():
    m, pool, t = FullHistoryManager(4), BlockPool(3), BlockTable()
    assert not m.acquire(pool, t, 9)
    assert t.page_ids() == [] and t.tail_avail == 0 and pool.num_free == 2


def test_sliding_reclaim_example():
    # B=2, W=4, 5 pages: reclaim at n=4 frees nothing; 5 frees page 0; 7 page 1; 11 pages 2, 3
    m, pool, t = SlidingWindowManager(2, 4), BlockPool(10), BlockTable()
    assert m.acquire(pool, t, 10)
    assert t.page_ids() == [1, 2, 3, 4, 5]
    assert m.reclaim_expired(pool, t, 4) == 0
    assert m.reclaim_expired(pool, t, 5) == 1 and t.page_ids() == [0, 2, 3, 4, 5]
    assert m.reclaim_expired(pool, t, 7) == 1 and t.page_ids() == [0, 0, 3, 4, 5]
    assert m.reclaim_expired(pool, t, 11) == 2 and t.page_ids() == [0, 0, 0, 0, 5]
    # FIFO: oldest page freed first, so it is evicted first
    assert pool.free_page_ids()[-4:] == [1, 2, 3, 4]


def test_live_tail_8192_pins_64_of_1024():
    m, pool, t = _live(), BlockPool(2000), BlockTable()
    assert m.blocks_needed_for(t, 8192) == 64
    assert SlidingWindowManager(8, 12).blocks_needed_for(t, 8192) == 1024
    assert m.acquire(pool, t, 8192)
    real = [s for s, p in enumerate(t.pages) if p]
    assert len(t.pages) == 1024 and len(real) == 64
    assert real == sorted({s for s in range(1024) if s >= 1022 or s % 32 >= 30})


def test_live_tail_300_fresh():
    m, pool, t = _live(), BlockPool(100), BlockTable()
    assert m.acquire(pool, t, 300)
    assert len(t.pages) == 38 and t.tail_avail == 4
    assert [s for s, p in enumerate(t.pages) if p] == [30, 31, 36, 37]
    assert t.page_ids()[30:32] == [1, 2] and t.page_ids()[36:] == [3, 4]


@pytest.mark.parametrize(
    "m,tokens",
    [
        (SlidingWindowManager(8, 512, live_tail_alignment=256), 256),  # W >= extent
        (SlidingWindowManager(128, 132, live_tail_alignment=256), 1024),  # resume span >= alignment
        (SlidingWindowManager(8, 12, live_tail_alignment=0), 8192),  # A = 0: plain allocation
    ],
)
def test_live_tail_degenerates_to_full_allocation(m, tokens):
    t = BlockTable()
    plain = SlidingWindowManager(m.page_size, m.window)
    assert m.blocks_needed_for(t, tokens) == plain.blocks_needed_for(t, tokens) == -(-tokens // m.page_size)


def test_live_tail_demand_is_non_monotonic_and_sequential_charge():
    m, t = _live(), BlockTable()
    assert m.blocks_needed_for(t, 17) == 3
    assert m.blocks_needed_for(t, 19) == 2
    assert m.blocks_needed_for_sequential(t, 17, 2) == 3
    assert m.blocks_needed_for_sequential(t, 17, 10) == 4
    reserves = {(17, 2): 0, (18, 2): 0, (16, 3): 1, (17, 10): 1, (24, 2): 1, (8192, 16): 2, (3, 4): 0}
    for (chunk, extra), want in reserves.items():
        r = m.blocks_needed_for_sequential(t, chunk, extra) - m.blocks_needed_for(t, chunk)
        assert r == want, (chunk, extra)
        pool, real = BlockPool(2000), BlockTable()
        assert m.acquire(pool, real, chunk)
        before = pool.num_free
        assert m.acquire(pool, real, extra)
        assert before - pool.num_free == want  # the reserve is what the 2nd acquire pins


def test_live_tail_chunk_sequence_pins_predicted_pages():
    m, pool, t = _live(), BlockPool(4000), BlockTable()
    pinned = []
    for chunk in [777, 1, 7, 8192, 640, 3, 2048, 12345]:
        predicted = m.blocks_needed_for(t, chunk)
        before = pool.num_free
        assert m.acquire(pool, t, chunk)
        assert before - pool.num_free == predicted
        pinned.append(predicted)
    assert pinned == [8, 0, 1, 67, 7, 0, 18, 98]


def test_reclaim_floor_bounds_the_scan():
    m, pool, t = _live(), BlockPool(2000), BlockTable()
    assert m.acquire(pool, t, 8192)
    assert m.reclaim_expired(pool, t, 8192) == 62
    assert sum(1 for p in t.pages if p) == 2 and t.reclaim_floor == 1022
    assert m.acquire(pool, t, 16)
    assert m.blocks_reclaimable_at(t, 8208) == 2
    assert m.blocks_reclaimable_at(t, 8208, pool=pool) == 2
    assert m.reclaim_expired(pool, t, 8208) == 2
    assert m.reclaim_expired(pool, t, 8208) == 0
    assert t.reclaim_floor == 1024


def test_reclaimable_counts_only_pages_reaching_zero_and_cached_filter():
    m, pool, t = SlidingWindowManager(2, 4), BlockPool(10), BlockTable()
    m.acquire(pool, t, 10)  # [1..5]
    pool.touch([1])  # shared with someone else: reclaim would not free it
    pool.register(2, "k2")
    assert m.blocks_reclaimable_at(t, 7) == 2
    assert m.blocks_reclaimable_at(t, 7, pool=pool) == 1
    assert m.blocks_reclaimable_at(t, 7, count_uncached=False, pool=pool) == 1
    pool.touch([2])
    assert m.blocks_reclaimable_at(t, 7, count_uncached=False, pool=pool) == 0


def test_state_manager_is_w2_sliding():
    m, pool, t = StateManager(4), BlockPool(10), BlockTable()
    assert m.window == 2 and m.resume_pages == 1
    m.acquire(pool, t, 12)
    assert m.reclaim_expired(pool, t, 12) == 2 and t.page_ids() == [0, 0, 3]


def test_free_releases_everything():
    m, pool, t = _live(), BlockPool(200), BlockTable()
    m.acquire(pool, t, 300)
    m.free(pool, t)
    assert pool.num_free == 199 and t.page_ids() == [] and t.tail_avail == 0


def test_bad_manager_arguments():
    with pytest.raises(ValueError):
        SlidingWindowManager(8, 0)
    with pytest.raises(ValueError):
        SlidingWindowManager(8, 12, live_tail_alignment=12)
    with pytest.raises(ValueError):
        FullHistoryManager(0)
    with pytest.raises(ValueError):
        FullHistoryManager(4).blocks_needed_for(BlockTable(), -1)
