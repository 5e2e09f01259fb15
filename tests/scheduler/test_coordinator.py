"""CacheCoordinator: §4 numbers, prefix match across groups, publish/adopt, literal page ids."""

from __future__ import annotations

import pytest

from scheduler import BlockPool, CacheCoordinator, PagedCacheGroupSpec, SlidingWindowManager
from scheduler.hashing import PrefixHasher

FULL256 = PagedCacheGroupSpec("full", "full_history", 256, 1, None)
SLIDE128 = PagedCacheGroupSpec("swa", "sliding_window", 128, 1, 511)
CONV8 = PagedCacheGroupSpec("conv", "sliding_window", 8, 1, 12, live_tail_alloc=True)


def test_design_example_demand():
    coord = CacheCoordinator([FULL256, SLIDE128, CONV8], BlockPool(1000))
    assert coord.lcm == 256 and coord.base == 8
    assert coord.managers[2].live_tail_alignment == 256
    tables = coord.new_tables()
    assert coord.blocks_needed_for(tables, 8192) == 32 + 64 + 64
    two = CacheCoordinator([FULL256, CONV8], BlockPool(10))
    assert two.blocks_needed_for_sequential(two.new_tables(), 17, 2) == 1 + 3


def test_acquire_is_check_then_act_across_groups():
    pool = BlockPool(100)
    coord = CacheCoordinator([FULL256, SLIDE128, CONV8], pool)
    tables = coord.new_tables()
    assert not coord.acquire(tables, 8192)  # needs 160 > 99
    assert [t.page_ids() for t in tables] == [[], [], []] and pool.num_free == 99
    assert coord.acquire(tables, 1024)
    assert [len(t.pages) for t in tables] == [4, 8, 128]
    assert not coord.acquire(tables, 1024, available=(10,))
    coord.free(tables)
    assert pool.num_free == 99


def _lookup_from(cached: dict[int, int]):
    return lambda slot: cached.get(slot)


def test_sliding_match_scenarios_b4_w10():
    m = SlidingWindowManager(4, 10)  # resume pages = ceil(9/4) = 3
    # cached {1,2,3} of 5 keys -> [hole, b1, b2, b3]
    assert m.match(_lookup_from({1: 11, 2: 12, 3: 13}), 5, 20) == (16, [0, 11, 12, 13])
    # cached {0,1,3,4} -> the run at the right is too short; the run reaching the start wins
    assert m.match(_lookup_from({0: 10, 1: 11, 3: 13, 4: 14}), 5, 20) == (8, [10, 11])
    # all cached: the highest boundary, only the 3 resume pages are kept
    assert m.match(_lookup_from({i: 10 + i for i in range(5)}), 5, 20) == (20, [0, 0, 12, 13, 14])
    assert m.match(_lookup_from({}), 5, 20) == (0, [])


def _run_request(coord, tokens, hasher=None):
    hasher = hasher or PrefixHasher(coord.base)
    hasher.extend(tokens)
    tables = coord.new_tables()
    assert coord.acquire(tables, len(tokens))
    coord.publish(tables, hasher.hashes, len(tokens))
    return tables, hasher


def test_prefix_match_converges_on_one_lcm_boundary():
    full4 = PagedCacheGroupSpec("full", "full_history", 4, 1, None)
    swa8 = PagedCacheGroupSpec("swa", "sliding_window", 8, 1, 10)
    pool = BlockPool(64)
    coord = CacheCoordinator([full4, swa8], pool)
    assert coord.lcm == 8 and coord.base == 4
    prompt = list(range(100, 140))  # 40 tokens: 10 full pages, 5 swa pages
    tables, hasher = _run_request(coord, prompt)
    full_row, swa_row = tables[0].page_ids(), tables[1].page_ids()
    # a second request with the same 37-token prefix: limit 36 -> lcm-aligned 32
    h2 = PrefixHasher(coord.base)
    h2.extend(prompt[:37] + [7, 7, 7])
    hit, rows = coord.match_prefix(h2.hashes, 36)
    assert hit == 32
    assert rows[0] == full_row[:8]
    assert rows[1] == [0, 0] + swa_row[2:4]  # resume pages ceil(9/8) = 2 just behind 32
    # evict the swa page of slot 2: swa can resume neither at 32 (slots 2, 3) nor at 24
    # (slots 1, 2) but at 16 (slots 0, 1) -> the full group follows down to 16
    coord.free(tables)
    pool._evict_key(swa_row[2])
    hit, rows = coord.match_prefix(h2.hashes, 36)
    assert hit == 16 and rows == [full_row[:4], swa_row[:2]]


def test_publish_adopts_canonical_and_frees_duplicate():
    full4 = PagedCacheGroupSpec("full", "full_history", 4, 1, None)
    pool = BlockPool(16)
    coord = CacheCoordinator([full4], pool)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    a_tables, a_hash = _run_request(coord, prompt)  # pages [1, 2, 3], 1 and 2 published
    assert a_tables[0].page_ids() == [1, 2, 3]
    b_tables = coord.new_tables()
    assert coord.acquire(b_tables, len(prompt))  # computed privately into [4, 5, 6]
    assert b_tables[0].page_ids() == [4, 5, 6]
    moved = coord.publish(b_tables, a_hash.hashes, len(prompt))
    assert moved == [[0, 1]]
    assert b_tables[0].page_ids() == [1, 2, 6]
    assert pool.refcount(1) == 2 and pool.refcount(4) == 0 and pool.is_free(5)
    # without adoption the duplicate is registered beside the canonical page
    c_tables = coord.new_tables()
    coord.acquire(c_tables, len(prompt))
    assert coord.publish(c_tables, a_hash.hashes, len(prompt), adopt=False) == [[]]
    assert pool.key_of(c_tables[0].pages[0]) == pool.key_of(1)


def test_state_every_page_publishes_every_completed_state_page():
    """state_snapshots="every_page" (a device that snapshots every page end): a state page is
    registered as soon as it is complete, like a history page, chunk end or not."""
    full = PagedCacheGroupSpec("full", "full_history", 8, 1, None)
    state = PagedCacheGroupSpec("state", "sliding_window", 8, 1, 2, family="state")
    pool = BlockPool(64)
    coord = CacheCoordinator([full, state], pool, state_every_page=True)
    h = PrefixHasher(coord.base)
    h.extend(list(range(40)))
    tables = coord.new_tables()
    coord.acquire(tables, 36)
    assert tables[1].page_ids() == [6, 7, 8, 9, 10]
    coord.publish(tables, h.hashes, 36)  # 36 is no page boundary: pages of slots 0-3 are complete
    assert [pool.key_of(p) is not None for p in tables[1].page_ids()] == [True] * 4 + [False]
    # a request sharing 35 tokens resumes at 32: the state group needs only slot 3's snapshot
    assert coord.match_prefix(h.hashes, 35) == (32, [[1, 2, 3, 4], [0, 0, 0, 9]])


def test_publish_skips_holes_and_hashed_pages_state_only_at_aligned_chunk_end():
    conv = PagedCacheGroupSpec("conv", "sliding_window", 4, 1, 3, live_tail_alloc=True)
    full = PagedCacheGroupSpec("full", "full_history", 8, 1, None)
    state = PagedCacheGroupSpec("state", "sliding_window", 8, 1, 2, family="state")
    pool = BlockPool(64)
    coord = CacheCoordinator([conv, full, state], pool)
    h = PrefixHasher(coord.base)
    tokens = list(range(40))
    h.extend(tokens)
    tables = coord.new_tables()
    coord.acquire(tables, 36)
    conv_row = tables[0].page_ids()
    holes = [s for s, p in enumerate(conv_row) if p == 0]
    assert holes  # live tail left holes in the conv group
    coord.publish(tables, h.hashes, 36)
    assert all(pool.key_of(p) is not None for p in conv_row if p)
    # state: 36 is not page-aligned -> no snapshot registered
    assert all(pool.key_of(p) is None for p in tables[2].pages if p)
    coord.acquire(tables, 4)
    coord.publish(tables, h.hashes, 40)
    state_row = tables[2].page_ids()
    assert pool.key_of(state_row[4]) is not None
    assert all(pool.key_of(p) is None for p in state_row[:4] if p)


def test_state_pool_gives_state_groups_their_own_page_ids():
    """With `state_pool`, state groups take ids from it and history groups from the shared pool
    (each numbered from 1); demand, room and prefix pulls are per pool, and an acquire that one
    pool cannot serve changes neither."""
    full = PagedCacheGroupSpec("full", "full_history", 8, 1, None)
    state = PagedCacheGroupSpec("state", "sliding_window", 8, 1, 2, family="state")
    pool, spool = BlockPool(64), BlockPool(6)
    coord = CacheCoordinator([full, state], pool, state_every_page=True, state_pool=spool)
    assert coord.pools == (pool, spool) and coord.pool_index == [0, 1]
    h = PrefixHasher(coord.base)
    h.extend(list(range(48)))
    tables = coord.new_tables()
    assert coord.pages_needed(tables, 36) == (5, 5) and coord.blocks_needed_for(tables, 36) == 10
    assert not coord.acquire(tables, 48)  # 6 state pages, the state pool has 5
    assert [t.pages for t in tables] == [[], []] and coord.free_pages() == (63, 5)
    assert not coord.acquire(tables, 36, available=(63, 4))
    assert coord.acquire(tables, 36)
    assert [t.page_ids() for t in tables] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]
    assert coord.free_pages() == (58, 0)
    coord.publish(tables, h.hashes, 36)
    assert coord.reclaim(tables, 36) == [[], [0, 1, 2, 3]]  # W = 2: only the live state stays
    assert coord.free_pages() == (58, 4)
    # a request sharing 35 tokens resumes at 32 from the shared pool's pages and snapshot 4
    hit, rows = coord.match_prefix(h.hashes, 35)
    assert (hit, rows) == (32, [[1, 2, 3, 4], [0, 0, 0, 4]])
    assert coord.prefix_pages_in_free_list(rows) == (0, 1)  # snapshot 4 sits in the free list
    again = coord.new_tables()
    coord.claim_prefix(again, hit, rows)
    assert coord.free_pages() == (58, 3) and spool.refcount(4) == 1 and pool.refcount(4) == 2
    coord.free(again)
    coord.free(tables)
    assert coord.free_pages() == (63, 5)


def test_state_pool_needs_both_kinds_of_group():
    full = PagedCacheGroupSpec("full", "full_history", 8, 1, None)
    state = PagedCacheGroupSpec("state", "sliding_window", 8, 1, 2, family="state")
    with pytest.raises(ValueError, match="needs a state group"):
        CacheCoordinator([full], BlockPool(8), state_pool=BlockPool(8))
    with pytest.raises(ValueError, match="beside the state groups"):
        CacheCoordinator([state], BlockPool(8), state_pool=BlockPool(8))
