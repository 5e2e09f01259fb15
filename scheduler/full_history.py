"""Full-history cache groups, and the manager base whose defaults ARE full history (DESIGN §3).

Managers are pure policy over (pool, table) pairs, with no per-request state. A manager answers
three kinds of question for one group:
- growth: `acquire` (all-or-nothing) and its pure mirrors `blocks_needed_for[_sequential]`;
- retention: `reclaim_expired` / `blocks_reclaimable_at` (sliding groups only);
- prefix match: the largest cached boundary <= a limit, as a row with holes.
`CacheGroupManager` keeps every slot real and reclaims nothing (full history);
`sliding_window.py` overrides retention and prefix match for sliding-window and state groups.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.block_pool import NULL_PAGE, BlockPool
from scheduler.block_table import BlockTable, ceil_div

# slot -> cached page id, or None on a miss
SlotLookup = Callable[[int], "int | None"]


class CacheGroupManager:
    """Base: growth arithmetic shared by every retention policy."""

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.page_size = block_size  # SPEC.md spells the constructor argument `block_size`

    # --- which new slots get a real page (overridden by live-tail) -------------------------
    def _count_real(self, first_slot: int, num_slots: int, end: int) -> int:
        return num_slots

    def _is_real(self, slot: int, end: int) -> bool:
        return True

    # --- growth ----------------------------------------------------------------------------
    def _new_slots(self, table_slots: int, tail_avail: int, num_tokens: int) -> tuple[int, int]:
        """(new slots, new tail_avail) for appending `num_tokens`."""
        if num_tokens <= tail_avail:
            return 0, tail_avail - num_tokens
        over = num_tokens - tail_avail
        return ceil_div(over, self.page_size), (-over) % self.page_size

    def _demand(self, num_slots: int, tail_avail: int, num_tokens: int) -> tuple[int, int, int]:
        """(real pages needed, new slots, new tail_avail) of one acquire on a table shape."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        k, new_tail = self._new_slots(num_slots, tail_avail, num_tokens)
        if k == 0:
            return 0, 0, new_tail
        end = num_slots * self.page_size - tail_avail + num_tokens
        return self._count_real(num_slots, k, end), k, new_tail

    def blocks_needed_for(self, table: BlockTable, num_tokens: int) -> int:
        """Pages `acquire(table, num_tokens)` would take from the pool (exact mirror)."""
        return self._demand(len(table.pages), table.tail_avail, num_tokens)[0]

    def blocks_needed_for_sequential(self, table: BlockTable, first_tokens: int, extra_tokens: int) -> int:
        """Peak pages pinned by `acquire(first_tokens)` then `acquire(extra_tokens)`."""
        d1, k1, tail1 = self._demand(len(table.pages), table.tail_avail, first_tokens)
        d2 = self._demand(len(table.pages) + k1, tail1, extra_tokens)[0]
        return d1 + d2

    def acquire(self, pool: BlockPool, table: BlockTable, num_tokens: int) -> bool:
        """Append `num_tokens` of capacity; all or nothing. Returns False when pages are short."""
        need, k, new_tail = self._demand(len(table.pages), table.tail_avail, num_tokens)
        if need > pool.num_free:
            return False
        if k:
            first = len(table.pages)
            if need == k:
                table.pages.extend(pool.allocate(need))
            else:
                end = first * self.page_size - table.tail_avail + num_tokens
                fresh = iter(pool.allocate(need))
                table.pages.extend(
                    next(fresh) if self._is_real(s, end) else NULL_PAGE for s in range(first, first + k)
                )
        table.tail_avail = new_tail
        return True

    # --- retention (full history keeps everything) -----------------------------------------
    def reclaim_slots(self, pool: BlockPool, table: BlockTable, num_tokens: int) -> list[int]:
        """Slots turned into holes (pages freed) at extent `num_tokens`."""
        return []

    def reclaim_expired(self, pool: BlockPool, table: BlockTable, num_tokens: int) -> int:
        """Number of slots turned into holes by this call."""
        return len(self.reclaim_slots(pool, table, num_tokens))

    def blocks_reclaimable_at(
        self, table: BlockTable, num_tokens: int, count_uncached: bool = True, pool: BlockPool | None = None
    ) -> int:
        return 0

    def free(self, pool: BlockPool, table: BlockTable) -> None:
        """Release every page of the table (deepest first) and empty it."""
        pool.free(table.pages)
        table.reset()

    # --- prefix match ----------------------------------------------------------------------
    @property
    def resume_pages(self) -> int:
        """Pages just behind a boundary needed to resume there (full history: all of them)."""
        raise NotImplementedError

    def match(self, lookup: SlotLookup, max_slots: int, limit_tokens: int) -> tuple[int, list[int]]:
        """Largest boundary (tokens, multiple of page_size) <= limit_tokens that is a valid
        resume point given the cached pages, and the row (holes = 0) that resumes there."""
        raise NotImplementedError


class FullHistoryManager(CacheGroupManager):
    """Every slot stays real for the request's lifetime. Prefix match walks left to right."""

    def match(self, lookup: SlotLookup, max_slots: int, limit_tokens: int) -> tuple[int, list[int]]:
        pages: list[int] = []
        for slot in range(min(max_slots, limit_tokens // self.page_size)):
            page = lookup(slot)
            if page is None:
                break
            pages.append(page)
        return len(pages) * self.page_size, pages
