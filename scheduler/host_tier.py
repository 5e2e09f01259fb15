"""The host KV tier: a second page pool in host memory below the device pool (issue 49).

When the device pool evicts a hashed page (refcount 0, reallocated), its contents are copied to
a host page first; a prefix match that runs out of device pages continues into the host tier,
and a host hit is copied back into a free device page instead of recomputed. A retracted
request's published pages take the same road: they sit in the device free list, go to the host
when evicted, and come back when the request resumes (always cheaper than recomputing them).

The host decides, the device applies: the scheduler records each step's copies here and emits
them as one `PageCopies` record with the step's `StepOps` (fixed-shape page-id columns,
padding = the drop sentinel); the runner applies them before the step's writes.

Tiers are exclusive: a key lives in at most one tier's index (the device's, or this one's).
A save leaves the device index (the page was evicted) and enters this one; a load leaves this
one and enters the device's. A save becomes visible to prefix matches only once its step is
emitted (`PageCopies`), so no load of a step reads a host page the same step writes.

Host page ids are `0..num_pages-1` (no null page: the host tier has no page tables).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from scheduler.block_pool import CacheKey

# the copy columns' widths in pages: the device compiles one copy program per width and kind;
# more copies than the widest are padded to a multiple of it and applied in chunks of it
COPY_WIDTHS = (16, 128)


def copy_bucket(n: int) -> int:
    """Width C of the copy columns for `n` copies: the narrowest of `COPY_WIDTHS` that holds
    them, else `n` rounded up to a multiple of the widest."""
    for c in COPY_WIDTHS:
        if c >= n:
            return c
    top = COPY_WIDTHS[-1]
    return -(-n // top) * top


@dataclasses.dataclass(frozen=True)
class PageCopies:
    """One step's host-tier copies (`StepOps.copies`). The device applies them before the step
    writes anything, in this order: read every saved device page, write every loaded one (a page
    evicted and saved may be the one a load fills). C = `copy_bucket(max(num_saves, num_loads))`."""

    num_saves: int  # valid entries of save_pages / save_slots
    num_loads: int  # valid entries of load_slots / load_pages
    save_pages: np.ndarray  # i32[C] device pages copied to the host tier; num_pages padding (dropped)
    save_slots: np.ndarray  # i32[C] host page receiving each; host num_pages padding (dropped)
    load_slots: np.ndarray  # i32[C] host pages copied to the device; host num_pages padding (dropped)
    load_pages: np.ndarray  # i32[C] device page receiving each; num_pages padding (dropped)

    @property
    def width(self) -> int:
        """C: the copy columns' length (the copy program's shape key)."""
        return int(self.save_pages.shape[0])


class HostPagePool:
    """Host pages with a key index and an LRU: every page holding a key is evictable (nothing
    on the host is referenced: a hit is moved to the device, not shared)."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"host tier num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self._empty: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # pages holding a key, oldest first
        self._page_key: list[CacheKey | None] = [None] * num_pages
        self._key_page: dict[CacheKey, int] = {}
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def lookup(self, key: CacheKey) -> int | None:
        return self._key_page.get(key)

    def key_of(self, page: int) -> CacheKey | None:
        return self._page_key[page]

    def lru_pages(self) -> list[int]:
        """Pages holding a key, evicted next first (tests and debugging)."""
        return list(self._lru)

    def store(self, key: CacheKey) -> int:
        """A page to hold `key`: an empty one, else the least recently stored (its key goes)."""
        if key in self._key_page:
            raise RuntimeError(f"key {key!r} is already in the host tier")
        if self._empty:
            page = self._empty.pop()
        else:
            page = self._lru.popitem(last=False)[0]
            del self._key_page[self._page_key[page]]
            self.num_evictions += 1
        self._page_key[page] = key
        self._key_page[key] = page
        self._lru[page] = None
        return page

    def take(self, page: int) -> CacheKey:
        """Remove `page`'s key (its contents move to the device); the page becomes empty."""
        key = self._page_key[page]
        if key is None:
            raise RuntimeError(f"take of empty host page {page}")
        self._page_key[page] = None
        del self._key_page[key]
        del self._lru[page]
        self._empty.append(page)
        return key

    def drop_cached(self) -> int:
        """Forget every key (stale K/V); returns how many were dropped."""
        n = len(self._lru)
        for page in self._lru:
            self._page_key[page] = None
        self._key_page.clear()
        self._lru.clear()
        self._empty = list(range(self.num_pages - 1, -1, -1))
        return n

    def check_invariants(self) -> None:
        """Raise AssertionError unless every page is either empty or holds exactly one key, and
        the key index, the LRU and the empty list agree."""
        empty = set(self._empty)
        assert len(empty) == len(self._empty), "a host page is empty twice"
        assert not empty & set(self._lru), "a host page is both empty and cached"
        assert len(empty) + len(self._lru) == self.num_pages, "host pages lost"
        for page in range(self.num_pages):
            key = self._page_key[page]
            assert (key is None) == (page in empty), f"host page {page}: key {key!r}, empty={page in empty}"
            if key is not None:
                assert self._key_page[key] == page, f"host page {page}: index mismatch"
        assert len(self._key_page) == len(self._lru)


class HostTier:
    """The scheduler's side of the host tier: the host pool and this step's copies so far."""

    def __init__(self, num_pages: int, num_device_pages: int) -> None:
        self.pool = HostPagePool(num_pages)
        self.num_device_pages = num_device_pages
        self._saves: list[tuple[int, CacheKey]] = []  # (device page, key) evicted this step
        self._loads: list[tuple[int, int]] = []  # (host page, device page) claimed this step
        self._loaded: set[int] = set()  # device pages a load of this step fills
        self.stats = {"host_pages_saved": 0, "host_pages_loaded": 0}

    def lookup_marker(self, key: CacheKey) -> int | None:
        """A prefix-match hit in this tier as a row entry: `-(host page + 1)` (< 0; device page
        ids are >= 0, 0 the null page / a hole), or None."""
        page = self.pool.lookup(key)
        return None if page is None else -(page + 1)

    def evicted(self, page: int, key: CacheKey) -> None:
        """The device pool reallocated hashed `page`: save it (at this step's emit). Not a page
        a load of this step fills: the step's copies read saves before they write loads, so
        its key's contents are not on the device yet (they stay lost: a cache miss)."""
        if page not in self._loaded:
            self._saves.append((page, key))

    def claim(self, marker: int, device_page: int) -> CacheKey:
        """Load the host page behind `marker` into `device_page` this step; its key (to register
        on the device). The host page is free for reuse at once: its load reads it before any
        later save writes it (the runner gathers loads when the step is dispatched, and writes
        saves once their step's copy has run)."""
        host = -marker - 1
        self._loads.append((host, device_page))
        self._loaded.add(device_page)
        return self.pool.take(host)

    def forget(self, key: CacheKey) -> None:
        """The device registered `key` (recomputed it): the host copy goes (tiers are exclusive)."""
        page = self.pool.lookup(key)
        if page is not None:
            self.pool.take(page)

    def emit(self, device_has_key: Callable[[CacheKey], bool]) -> PageCopies | None:
        """This step's copies (None when there are none), and the saves enter the host index.
        `device_has_key(key)`: a key the device still holds (a duplicate page) is not saved."""
        keep, seen = [], set()
        for page, key in self._saves:  # a key two device pages carried is saved once
            if key not in seen and not device_has_key(key) and self.pool.lookup(key) is None:
                keep.append((page, key))
                seen.add(key)
        # more saves than host pages: the later ones would evict the earlier ones anyway (and
        # two saves of one step must not share a host page)
        keep = keep[-self.pool.num_pages :]
        saves = [(page, self.pool.store(key)) for page, key in keep]
        loads, self._saves, self._loads = self._loads, [], []
        self._loaded.clear()
        if not saves and not loads:
            return None
        c = copy_bucket(max(len(saves), len(loads)))
        cols = np.empty((4, c), np.int32)
        cols[0], cols[1] = self.num_device_pages, self.pool.num_pages
        cols[2], cols[3] = self.pool.num_pages, self.num_device_pages
        if saves:
            cols[0, : len(saves)], cols[1, : len(saves)] = zip(*saves)
        if loads:
            cols[2, : len(loads)], cols[3, : len(loads)] = zip(*loads)
        self.stats["host_pages_saved"] += len(saves)
        self.stats["host_pages_loaded"] += len(loads)
        return PageCopies(len(saves), len(loads), cols[0], cols[1], cols[2], cols[3])

    def drop_cached(self) -> int:
        assert not self._saves and not self._loads, "drop_cached with copies pending"
        return self.pool.drop_cached()
