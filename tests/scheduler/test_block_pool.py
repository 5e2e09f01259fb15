"""BlockPool: LRU free list, refcounts, hash retention and eviction, literal page ids."""

from __future__ import annotations

import pytest

from scheduler import NULL_PAGE, BlockPool


def test_new_pool_excludes_null_page():
    pool = BlockPool(6)
    assert NULL_PAGE == 0
    assert pool.num_free == 5
    assert pool.free_page_ids() == [1, 2, 3, 4, 5]
    assert pool.refcount(0) == 0
    pool.check_invariants({})


def test_allocate_is_all_or_nothing_and_pops_front():
    pool = BlockPool(5)
    assert pool.allocate(2) == [1, 2]
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free == 2
    assert pool.allocate(2) == [3, 4]
    pool.check_invariants({1: 1, 2: 1, 3: 1, 4: 1})


def test_free_goes_to_back_in_reverse_order_keeping_hash():
    pool = BlockPool(6)
    pages = pool.allocate(3)  # [1, 2, 3]
    pool.register(1, "h1")
    pool.register(2, "h2")
    pool.free(pages)  # reverse: 3, 2, 1 appended to the back
    assert pool.free_page_ids() == [4, 5, 3, 2, 1]
    assert pool.lookup("h1") == 1 and pool.lookup("h2") == 2
    # the chain's deepest page (2) is evicted before its parent (1)
    assert pool.allocate(3) == [4, 5, 3]
    assert pool.allocate(1) == [2]
    assert pool.lookup("h2") is None and pool.lookup("h1") == 1
    assert pool.num_evictions == 1


def test_touch_pulls_cached_free_page_out_of_free_list():
    pool = BlockPool(4)
    (p,) = pool.allocate(1)
    pool.register(p, "k")
    pool.free([p])
    assert pool.is_free(p)
    pool.touch([p, 0])
    assert not pool.is_free(p) and pool.refcount(p) == 1
    pool.touch([p])
    assert pool.refcount(p) == 2
    pool.free([p])
    pool.free([p])
    assert pool.is_free(p) and pool.lookup("k") == p
    pool.check_invariants({})


def test_peak_used_is_the_high_water_mark():
    pool = BlockPool(6)
    pages = pool.allocate(3)
    pool.register(pages[0], "k")
    pool.free(pages)
    assert pool.num_used == 0 and pool.peak_used == 3
    pool.allocate(2)  # pages 4, 5
    assert pool.peak_used == 3
    pool.touch([1])  # the cached page comes back: 3 in use again
    pool.allocate(1)
    assert pool.num_used == 4 and pool.peak_used == 4
    pool.reset_peak()
    assert pool.peak_used == 4


def test_duplicate_hashes_are_kept_side_by_side():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.register(a, "same")
    pool.register(b, "same")
    assert pool.lookup("same") == a  # canonical = oldest registration
    pool.free([a])
    pool.allocate(2)  # pops 3 then a: a's copy is evicted, b's stays
    assert pool.lookup("same") == b


def test_double_free_and_null_page_misuse_raise():
    pool = BlockPool(3)
    (p,) = pool.allocate(1)
    pool.free([p])
    with pytest.raises(RuntimeError):
        pool.free([p])
    with pytest.raises(ValueError):
        pool.register(0, "x")
    pool.free([0])  # the null page is ignored, never freed
    assert pool.num_free == 2
    with pytest.raises(ValueError):
        BlockPool(1)
