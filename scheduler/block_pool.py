"""`BlockPool`: one pool of page ids shared by every cache group (DESIGN.md §2).

Free pages sit in an LRU list (front = evicted next). A freed page keeps its prefix hash, so it is
both a prefix-cache hit candidate and evictable; reallocating it evicts the hash. Every operation is
O(1) per page: the free list is an `OrderedDict` (pop front, append back, remove by key). A plain
dict is not enough: popping its front with `next(iter(d))` skips every deleted slot left at the
front, so pops get O(num_pages) until the dict is rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

NULL_PAGE = 0

CacheKey = Hashable  # (group index, chained page hash)


class BlockPool:
    """Page ids `1..num_pages-1` with refcounts, an LRU free list and a prefix-hash index.

    Page 0 is the null page: never allocated, never freed, never cached.
    """

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is the null page), got {num_pages!r}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self._page_key: list[CacheKey | None] = [None] * num_pages
        # key -> pages carrying it, oldest registration first (duplicates allowed).
        self._key_pages: dict[CacheKey, dict[int, None]] = {}
        self.num_evictions = 0
        # called with (page, key) when reallocating a page evicts its key (the host tier saves it)
        self.on_evict: Callable[[int, CacheKey], None] | None = None
        self.peak_used = 0  # high-water mark of `num_used` (since creation or `reset_peak`)

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Free pages (cached-but-unreferenced pages included), page 0 excluded."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def reset_peak(self) -> None:
        """Restart the high-water mark from the pages in use now."""
        self.peak_used = self.num_used

    def refcount(self, page_id: int) -> int:
        return self._refcount[page_id]

    def is_free(self, page_id: int) -> bool:
        return page_id in self._free

    def key_of(self, page_id: int) -> CacheKey | None:
        return self._page_key[page_id]

    def has_key(self, key: CacheKey) -> bool:
        return key in self._key_pages

    def lookup(self, key: CacheKey) -> int | None:
        """The canonical (oldest registered) page carrying `key`, or None."""
        pages = self._key_pages.get(key)
        if not pages:
            return None
        return next(iter(pages))

    def free_page_ids(self) -> list[int]:
        """Free list in eviction order (front first). O(num_free): for tests and debugging."""
        return list(self._free)

    # ------------------------------------------------------------------ mutations
    def allocate(self, n: int) -> list[int]:
        """Pop `n` pages from the front of the free list, all or nothing.

        Raises RuntimeError when fewer than `n` pages are free: callers check `num_free` first
        (the host decides; running out here is a scheduler bug, not a user error).
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free pages")
        out = []
        pop = self._free.popitem
        rc, keys = self._refcount, self._page_key
        for _ in range(n):
            page = pop(last=False)[0]
            if keys[page] is not None:
                self._evict_key(page)
            rc[page] = 1
            out.append(page)
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def touch(self, pages: Iterable[int]) -> None:
        """Take a reference on each (non-null) page; a free cached page leaves the free list."""
        rc = self._refcount
        for page in pages:
            if page == NULL_PAGE:
                continue
            if rc[page] == 0:
                if self._page_key[page] is None:
                    raise RuntimeError(f"touch of free page {page} that carries no hash")
                del self._free[page]
            rc[page] += 1
        self.peak_used = max(self.peak_used, self.num_used)

    def free(self, pages: list[int], *, reverse: bool = True) -> None:
        """Drop one reference on each non-null page; a page reaching 0 goes to the BACK of the
        free list keeping its hash. Freed in reverse order by default so that a chain's deepest
        page is evicted first; `reverse=False` frees oldest first (sliding-window reclaim)."""
        rc = self._refcount
        for page in reversed(pages) if reverse else pages:
            if page == NULL_PAGE:
                continue
            if rc[page] <= 0:
                raise RuntimeError(f"double free of page {page}")
            rc[page] -= 1
            if rc[page] == 0:
                self._free[page] = None

    def register(self, page: int, key: CacheKey) -> None:
        """Publish a live page under `key` (prefix cache). Duplicated keys are kept side by side."""
        if page == NULL_PAGE:
            raise ValueError("the null page is never cached")
        if self._page_key[page] is not None:
            raise RuntimeError(f"page {page} already carries a hash")
        self._page_key[page] = key
        self._key_pages.setdefault(key, {})[page] = None

    def _evict_key(self, page: int) -> None:
        key = self._page_key[page]
        if key is None:
            return
        self._page_key[page] = None
        pages = self._key_pages[key]
        del pages[page]
        if not pages:
            del self._key_pages[key]
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(page, key)

    def drop_cached(self) -> int:
        """Forget every prefix hash (the pages' K/V are stale: new weights, or a freed pool);
        pages stay where they are (free or held). Returns how many hashes were dropped."""
        n = 0
        for page in range(1, self.num_pages):
            if self._page_key[page] is not None:
                self._page_key[page] = None
                n += 1
        self._key_pages.clear()
        return n

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, expected_refcounts: dict[int, int] | None = None) -> None:
        """Raise AssertionError when the pool is inconsistent.

        `expected_refcounts`: page -> references held by all tables; when given, every page's
        refcount must equal it exactly (pages absent from the dict must be unreferenced).
        """
        rc = self._refcount
        assert rc[NULL_PAGE] == 0, "null page has a refcount"
        assert NULL_PAGE not in self._free, "null page is on the free list"
        assert self._page_key[NULL_PAGE] is None, "null page carries a hash"
        live = 0
        for page in range(1, self.num_pages):
            in_free = page in self._free
            assert rc[page] >= 0, f"negative refcount on page {page}"
            assert in_free == (rc[page] == 0), f"page {page}: free={in_free} refcount={rc[page]}"
            live += not in_free
            if expected_refcounts is not None:
                want = expected_refcounts.get(page, 0)
                assert rc[page] == want, f"page {page}: refcount {rc[page]} != table refs {want}"
        assert live + len(self._free) == self.num_pages - 1, "free + referenced != num_pages - 1"
        for key, pages in self._key_pages.items():
            assert pages, f"empty page set for key {key!r}"
            for page in pages:
                assert self._page_key[page] == key, f"page {page} index mismatch"
        if expected_refcounts is not None:
            assert NULL_PAGE not in expected_refcounts or expected_refcounts[NULL_PAGE] == 0
