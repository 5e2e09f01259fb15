"""`CacheCoordinator`: all cache groups of one request over one shared pool (DESIGN.md §4-5),
or over two: the recurrent-state groups may get a pool of their own (`state_pool`).

Why two: the device gives every page id of a pool a slot in every layer that pool serves, so
over one shared pool each attention page also pays every recurrent layer's state snapshot and
each snapshot pays every attention layer's K/V (at Qwen3.5-0.8B layer shapes and 16-token pages,
3.21 MiB of state beside 64 KiB of K/V per id). With a state pool each kind of page pays only
its own layers. The accounting is then per pool: `pages_needed*`, `free_pages` and the admission
ledger are tuples with one entry per pool (`pools`), and a demand fits when every entry does
(`fits`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import reduce

from scheduler.block_pool import NULL_PAGE, BlockPool
from scheduler.block_table import BlockTable, ceil_div
from scheduler.full_history import CacheGroupManager, FullHistoryManager
from scheduler.group_spec import PagedCacheGroupSpec
from scheduler.host_tier import HostTier
from scheduler.sliding_window import SlidingWindowManager, StateManager, window_tokens


class CacheCoordinator:
    """Check-then-act growth, prefix match, publish/adopt and reclaim across groups."""

    def __init__(
        self,
        specs: list[PagedCacheGroupSpec],
        pool: BlockPool,
        state_every_page: bool = False,
        state_pool: BlockPool | None = None,
    ) -> None:
        if not specs:
            raise ValueError("CacheCoordinator needs at least one group spec")
        ids = [s.group_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate group ids in {ids}")
        self.specs = list(specs)
        self.pool = pool  # the shared pool (every group's, but the state groups' with a state pool)
        if state_pool is not None:
            if all(s.family != "state" for s in specs):
                raise ValueError(f"a state pool needs a state group; groups are {ids}")
            if all(s.family == "state" for s in specs):
                raise ValueError(f"a state pool needs a group beside the state groups; groups are {ids}")
        self.pools: tuple[BlockPool, ...] = (pool,) if state_pool is None else (pool, state_pool)
        self.pool_index = pool_indices(specs, state_pool is not None)
        self._pool_of = [self.pools[i] for i in self.pool_index]
        self.state_every_page = state_every_page  # SchedulerConfig.state_snapshots == "every_page"
        sizes = [s.page_size for s in specs]
        self.base = reduce(math.gcd, sizes)
        self.lcm = reduce(math.lcm, sizes)
        self.managers: list[CacheGroupManager] = [self._make_manager(s) for s in specs]
        self.host: HostTier | None = None  # the host KV tier (`attach_host_tier`), if any
        # base pages per group page: group page i is keyed by base hash (i+1)*k - 1
        self._base_per_page = [b // self.base for b in sizes]
        # (group, W - 1, B) of every sliding group: the reclaim-due test of `grow_in_tail`
        self._sliding = [
            (g, m.window - 1, m.page_size)
            for g, m in enumerate(self.managers)
            if isinstance(m, SlidingWindowManager)
        ]

    def attach_host_tier(self, host: HostTier) -> None:
        """Below the device pool: evicted hashed pages are saved there, and prefix matches
        continue into it (`scheduler.host_tier`)."""
        if len(self.pools) > 1:
            raise ValueError("a host KV tier needs the one shared pool (no state pool)")
        self.host = host
        self.pool.on_evict = host.evicted

    def _make_manager(self, spec: PagedCacheGroupSpec) -> CacheGroupManager:
        b = spec.page_size
        if spec.family == "state":
            return StateManager(b)
        if spec.retention == "full_history":
            return FullHistoryManager(b)
        return SlidingWindowManager(
            b, window_tokens(spec), live_tail_alignment=self.lcm if spec.live_tail_alloc else 0
        )

    # ------------------------------------------------------------------ growth
    def new_tables(self) -> list[BlockTable]:
        return [BlockTable() for _ in self.specs]

    def blocks_needed_for(self, tables: list[BlockTable], num_tokens: int) -> int:
        return sum(m.blocks_needed_for(t, num_tokens) for m, t in zip(self.managers, tables))

    def blocks_needed_for_sequential(
        self, tables: list[BlockTable], first_tokens: int, extra_tokens: int
    ) -> int:
        return sum(
            m.blocks_needed_for_sequential(t, first_tokens, extra_tokens)
            for m, t in zip(self.managers, tables)
        )

    # per pool: tuples with one entry per pool of `pools`
    def split(self, per_group: Iterable[int]) -> tuple[int, ...]:
        """Per-group page counts summed per pool."""
        if len(self.pools) == 1:
            return (sum(per_group),)
        out = [0] * len(self.pools)
        for i, n in zip(self.pool_index, per_group):
            out[i] += n
        return tuple(out)

    def free_pages(self) -> tuple[int, ...]:
        if len(self.pools) == 1:  # the hot path's case: no generator
            return (self.pool.num_free,)
        return tuple(p.num_free for p in self.pools)

    def pages_needed(self, tables: list[BlockTable], num_tokens: int) -> tuple[int, ...]:
        """`blocks_needed_for` per pool."""
        return self.split(m.blocks_needed_for(t, num_tokens) for m, t in zip(self.managers, tables))

    def pages_needed_sequential(
        self, tables: list[BlockTable], first_tokens: int, extra_tokens: int
    ) -> tuple[int, ...]:
        """`blocks_needed_for_sequential` per pool."""
        return self.split(
            m.blocks_needed_for_sequential(t, first_tokens, extra_tokens)
            for m, t in zip(self.managers, tables)
        )

    def acquire(
        self, tables: list[BlockTable], num_tokens: int, available: tuple[int, ...] | None = None
    ) -> bool:
        """Grow every group by `num_tokens`, or change nothing. `available` caps the pages this
        call may take from each pool (default: all free pages), so reservations of others can
        be honoured."""
        need = self.pages_needed(tables, num_tokens)
        limit = self.free_pages()
        if available is not None:
            limit = (min(available[0], limit[0]),) if len(limit) == 1 else tuple(map(min, available, limit))
        if not fits(need, limit):
            return False
        for m, t, pool in zip(self.managers, tables, self._pool_of):
            ok = m.acquire(pool, t, num_tokens)
            assert ok, "coordinator demand mirror disagrees with a manager's acquire"
        return True

    def grow_in_tail(self, tables: list[BlockTable], extent: int) -> bool:
        """Decode fast path: if no group needs a new page for one more token and no sliding group
        has a slot to reclaim at `extent` (tokens in cache), take the token from every tail and
        return True; otherwise change nothing and return False. When it returns True, the state
        is exactly what `reclaim(tables, extent)` then `acquire(tables, 1)` would leave."""
        for t in tables:
            if t.tail_avail < 1:
                return False
        for g, wm1, b in self._sliding:
            t = tables[g]
            floor = t.reclaim_floor
            if (extent - wm1) // b > floor and len(t.pages) > floor:
                return False
        for t in tables:
            t.tail_avail -= 1
        return True

    def solo_peak_pages(self, total_tokens: int, max_chunk_tokens: int) -> int:
        """`solo_peak_pages` of this coordinator's groups."""
        return solo_peak_pages(self.specs, total_tokens, max_chunk_tokens)

    def solo_peak_by_pool(self, total_tokens: int, max_chunk_tokens: int) -> tuple[int, ...]:
        """`solo_peak_pages` per pool."""
        return solo_peak_by_pool(self.specs, total_tokens, max_chunk_tokens, len(self.pools) > 1)

    def truncate(self, tables: list[BlockTable], num_tokens: int) -> bool:
        """Roll every group back to `num_tokens` tokens (speculative decoding: positions a step
        wrote for rejected drafts). Slots wholly past it leave the table and their pages go back
        to the pool: they were acquired by that step alone, so nothing else references them and
        nothing published them. Returns True when a slot left (the device row must refresh)."""
        dropped = False
        for m, t, pool in zip(self.managers, tables, self._pool_of):
            b = m.page_size
            keep = ceil_div(num_tokens, b)
            if keep < len(t.pages):
                gone = [p for p in t.pages[keep:] if p != NULL_PAGE]
                assert all(pool.refcount(p) == 1 and pool.key_of(p) is None for p in gone), (
                    "rolled-back pages must be private and unpublished"
                )
                del t.pages[keep:]
                pool.free(gone)
                t.num_published = min(t.num_published, keep)
                t.reclaim_floor = min(t.reclaim_floor, keep)
                dropped = True
            t.tail_avail = keep * b - num_tokens
        return dropped

    def free(self, tables: list[BlockTable]) -> None:
        for m, t, pool in zip(self.managers, tables, self._pool_of):
            m.free(pool, t)

    # ------------------------------------------------------------------ retention
    def reclaim(self, tables: list[BlockTable], num_tokens: int) -> list[list[int]]:
        """Reclaim slid-out slots at extent `num_tokens`; returns the new hole slots per group."""
        return [m.reclaim_slots(p, t, num_tokens) for m, t, p in zip(self.managers, tables, self._pool_of)]

    def blocks_reclaimable_at(self, tables: list[BlockTable], num_tokens: int) -> int:
        return sum(
            m.blocks_reclaimable_at(t, num_tokens, pool=p)
            for m, t, p in zip(self.managers, tables, self._pool_of)
        )

    # ------------------------------------------------------------------ prefix cache
    def _lookup(self, g: int, base_hashes: list[bytes], use_host: bool) -> Callable[[int], int | None]:
        k = self._base_per_page[g]
        pool = self._pool_of[g]
        host = self.host if use_host else None

        def lookup(slot: int) -> int | None:
            key = (g, base_hashes[(slot + 1) * k - 1])
            page = pool.lookup(key)
            if page is None and host is not None:
                return host.lookup_marker(key)
            return page

        return lookup

    def match_prefix(
        self, base_hashes: list[bytes], limit_tokens: int, use_host: bool = True
    ) -> tuple[int, list[list[int]]]:
        """Longest lcm-aligned boundary <= limit_tokens at which every group can resume, and the
        per-group rows (holes = 0) to resume with. Nothing is claimed. With a host tier
        (`use_host`), a slot the device pool misses may hit there: its row entry is a host
        marker (< 0, `HostTier.lookup_marker`) that `claim_prefix` loads into a device page."""
        limit = min(limit_tokens, len(base_hashes) * self.base)
        limit -= limit % self.lcm
        lookups = [self._lookup(g, base_hashes, use_host) for g in range(len(self.specs))]
        max_slots = [len(base_hashes) // k for k in self._base_per_page]
        while limit > 0:
            rows = []
            boundary = limit
            for g, m in enumerate(self.managers):
                got, row = m.match(lookups[g], max_slots[g], limit)
                boundary = min(boundary, got)
                rows.append(row)
            if boundary == limit:
                return limit, rows
            limit = boundary - boundary % self.lcm
        return 0, [[] for _ in self.specs]

    def claim_prefix(self, tables: list[BlockTable], num_tokens: int, rows: list[list[int]]) -> None:
        """Point fresh tables at matched rows and take a reference on every hit page. Host hits
        (markers < 0) get a fresh device page each, loaded from the host tier this step."""
        for row, pool in zip(rows, self._pool_of):  # device hits first: allocating for the
            pool.touch(p for p in row if p > 0)  # host hits must not evict them
        host = self.host
        for g, row in enumerate(rows):
            marked = [i for i, p in enumerate(row) if p < 0]
            if not marked:
                continue
            assert host is not None, "a host marker without a host tier"
            row = rows[g] = list(row)
            for i, page in zip(marked, self.pool.allocate(len(marked))):
                key = host.claim(row[i], page)
                self.pool.register(page, key)
                row[i] = page
        for m, t, row in zip(self.managers, tables, rows):
            assert not t.pages, "claim_prefix needs fresh tables"
            assert len(row) * m.page_size == num_tokens
            t.pages = list(row)
            t.tail_avail = 0
            t.num_published = len(row)
            floor = 0
            while floor < len(row) and row[floor] == NULL_PAGE:
                floor += 1
            t.reclaim_floor = floor

    def prefix_pages_in_free_list(self, rows: list[list[int]]) -> tuple[int, ...]:
        """Hit pages that claiming would pull out of each pool's free list (they cost free
        pages); a host hit costs the free page it is loaded into."""
        return self.split(
            sum(1 for p in set(row) if p > 0 and pool.is_free(p)) + sum(1 for p in row if p < 0)
            for row, pool in zip(rows, self._pool_of)
        )

    def publish(
        self,
        tables: list[BlockTable],
        base_hashes: list[bytes],
        num_tokens: int,
        adopt: bool = True,
        chunk_end: bool = True,
    ) -> list[list[int]]:
        """Register completed pages (computed tokens < num_tokens) under their hashes.

        Holes and already-hashed pages are skipped. With `adopt`, a page whose hash already has a
        canonical page is repointed to it and the private duplicate freed. State groups register
        only the page ending exactly at a chunk end (`chunk_end` and page-aligned), or every
        completed page with `state_every_page` (the device snapshots every page end).
        Returns, per group, the slots whose page id changed (adoption), for the mirror."""
        changed: list[list[int]] = []
        for g, (spec, t, pool) in enumerate(zip(self.specs, tables, self._pool_of)):
            k = self._base_per_page[g]
            b = spec.page_size
            complete = min(num_tokens // b, len(base_hashes) // k, len(t.pages))
            moved: list[int] = []
            start = t.num_published
            if spec.family == "state" and not self.state_every_page:
                start = complete - 1 if chunk_end and num_tokens % b == 0 else complete
                start = max(start, t.num_published)
            for slot in range(start, complete):
                page = t.pages[slot]
                if page == NULL_PAGE or pool.key_of(page) is not None:
                    continue
                key = (g, base_hashes[(slot + 1) * k - 1])
                canonical = pool.lookup(key)
                if canonical is None or not adopt:
                    pool.register(page, key)
                    if self.host is not None:
                        self.host.forget(key)  # recomputed: a key lives in one tier only
                elif canonical != page:
                    pool.touch([canonical])
                    t.pages[slot] = canonical
                    pool.free([page])
                    moved.append(slot)
            t.num_published = max(t.num_published, complete)
            changed.append(moved)
        return changed


def fits(need: tuple[int, ...], room: tuple[int, ...]) -> bool:
    """Whether a per-pool demand fits per-pool room, entry by entry."""
    if len(need) == 1:  # one shared pool: the scheduler's hot path, no generator
        return need[0] <= room[0]
    return all(n <= r for n, r in zip(need, room))


def pool_indices(specs: list[PagedCacheGroupSpec], state_pool: bool) -> list[int]:
    """Index into `CacheCoordinator.pools` of each group's pool: 1 for the state groups when
    they have a pool of their own (`state_pool`), else 0 (the shared pool)."""
    return [int(state_pool and s.family == "state") for s in specs]


def solo_peak_by_pool(
    specs: list[PagedCacheGroupSpec], total_tokens: int, max_chunk_tokens: int, state_pool: bool
) -> tuple[int, ...]:
    """`solo_peak_pages` of each pool (`pool_indices`), from the specs alone (a preflight check
    needs no Scheduler)."""
    out = [0] * (2 if state_pool else 1)
    for spec, i in zip(specs, pool_indices(specs, state_pool)):
        out[i] += solo_peak_pages([spec], total_tokens, max_chunk_tokens)
    return tuple(out)


def solo_peak_pages(specs: list[PagedCacheGroupSpec], total_tokens: int, max_chunk_tokens: int) -> int:
    """Upper bound on the pages one request of `total_tokens` pins at once when it runs alone
    with chunks of at most `max_chunk_tokens` (sliding groups: window + chunk). From the specs
    alone, so a preflight check needs no Scheduler."""
    need = 0
    for spec in specs:
        b = spec.page_size
        full = ceil_div(total_tokens, b)
        if spec.retention == "full_history":
            need += full
        else:  # the pages to resume behind a boundary (`resume_pages`), the chunk, two edges
            resume = ceil_div(window_tokens(spec) - 1, b)
            need += min(full, resume + ceil_div(min(max_chunk_tokens, total_tokens), b) + 2)
    return need
