"""Sliding-window groups: reclaim, reclaim floor, live-tail allocation, state groups (DESIGN §3)."""

from __future__ import annotations

from typing import cast

from scheduler.block_pool import NULL_PAGE, BlockPool
from scheduler.block_table import BlockTable, ceil_div
from scheduler.full_history import CacheGroupManager, SlotLookup
from scheduler.group_spec import PagedCacheGroupSpec


class SlidingWindowManager(CacheGroupManager):
    """A query at position n reads tokens [n-W+1, n]; fully slid-out slots become holes.

    `live_tail_alignment` A > 0 turns on live-tail allocation: a new slot gets a real page only
    if it is in the live tail at this acquire's frontier or is one of the resume pages just
    before an A-aligned boundary. Only safe for groups whose in-flight reads never come from the
    pool (conv state); attention groups keep A = 0.
    """

    def __init__(self, block_size: int, window: int, live_tail_alignment: int = 0) -> None:
        super().__init__(block_size)
        if not isinstance(window, int) or window <= 0:
            raise ValueError(f"sliding window must be a positive int, got {window!r}")
        if live_tail_alignment < 0 or (live_tail_alignment and live_tail_alignment % block_size):
            raise ValueError(
                f"live_tail_alignment {live_tail_alignment} must be 0 or a multiple "
                f"of block_size {block_size}"
            )
        self.window = window
        self.live_tail_alignment = live_tail_alignment
        self._resume = ceil_div(window - 1, block_size)
        self._period = live_tail_alignment // block_size  # slots per aligned span (0 = off)

    @property
    def resume_pages(self) -> int:
        return self._resume

    def slid_out_bound(self, num_tokens: int) -> int:
        """Slots strictly below this are fully slid out at extent `num_tokens`."""
        return max(0, (num_tokens - self.window + 1) // self.page_size)

    # --- live-tail -------------------------------------------------------------------------
    def _live_tail_off(self) -> bool:
        return self._period == 0 or self._resume >= self._period

    def _is_real(self, slot: int, end: int) -> bool:
        if self._live_tail_off():
            return True
        return slot >= self.slid_out_bound(end) or slot % self._period >= self._period - self._resume

    def _checkpoints_below(self, x: int) -> int:
        """Slots s in [0, x) with s % period >= period - resume."""
        p, r = self._period, self._resume
        return (x // p) * r + max(0, x % p - (p - r))

    def _count_real(self, first_slot: int, num_slots: int, end: int) -> int:
        if self._live_tail_off():
            return num_slots
        stop = first_slot + num_slots
        lo = min(max(first_slot, self.slid_out_bound(end)), stop)
        return (stop - lo) + self._checkpoints_below(lo) - self._checkpoints_below(first_slot)

    # --- retention -------------------------------------------------------------------------
    def reclaim_slots(self, pool: BlockPool, table: BlockTable, num_tokens: int) -> list[int]:
        """Turn slots fully slid out at extent `num_tokens` into holes, free their pages oldest
        first, and return those slots.

        Scans only [reclaim_floor, bound) and raises the floor, so a decode step costs
        O(newly expired slots), not O(context)."""
        pages = table.pages
        bound = min(self.slid_out_bound(num_tokens), len(pages))
        if bound <= table.reclaim_floor:
            return []
        slots, freed = [], []
        for slot in range(table.reclaim_floor, bound):
            page = pages[slot]
            if page != NULL_PAGE:
                slots.append(slot)
                freed.append(page)
                pages[slot] = NULL_PAGE
        table.reclaim_floor = bound
        pool.free(freed, reverse=False)
        return slots

    def blocks_reclaimable_at(
        self, table: BlockTable, num_tokens: int, count_uncached: bool = True, pool: BlockPool | None = None
    ) -> int:
        """Pages `reclaim_expired(num_tokens)` would return to the free list.

        With `pool`, only pages whose refcount would reach 0 count, and `count_uncached=False`
        further skips pages that carry no prefix hash. Without `pool` every real page counts."""
        pages = table.pages
        bound = min(self.slid_out_bound(num_tokens), len(pages))
        n = 0
        for slot in range(table.reclaim_floor, bound):
            page = pages[slot]
            if page == NULL_PAGE:
                continue
            if pool is not None and (
                pool.refcount(page) != 1 or (not count_uncached and pool.key_of(page) is None)
            ):
                continue
            n += 1
        return n

    # --- prefix match ----------------------------------------------------------------------
    def match(self, lookup: SlotLookup, max_slots: int, limit_tokens: int) -> tuple[int, list[int]]:
        """Right to left: the highest boundary whose `resume_pages` slots just behind it are
        cached (or whose cached run reaches slot 0). Slots below the run become holes."""
        need = self._resume
        j = min(max_slots, limit_tokens // self.page_size)
        while j > 0:
            run: list[int] = []
            slot = j - 1
            while slot >= 0 and len(run) < need:
                page = lookup(slot)
                if page is None:
                    break
                run.append(page)
                slot -= 1
            if len(run) >= need or slot < 0:
                run.reverse()
                return j * self.page_size, [NULL_PAGE] * (j - len(run)) + run
            j = slot  # the miss at `slot` rules out every boundary above it
        return 0, []


STATE_WINDOW = 2  # a state group keeps the live state and the one before it


def window_tokens(spec: PagedCacheGroupSpec) -> int:
    """W of a sliding or state group (`SlidingWindowManager.window`)."""
    return STATE_WINDOW if spec.family == "state" else cast(int, spec.sliding_window_tokens)


class StateManager(SlidingWindowManager):
    """Recurrent-state (Mamba-like) group: a sliding group with W = 2, one snapshot per page.

    Snapshots are only registered at page-aligned chunk ends (see the coordinator's publish)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size, window=STATE_WINDOW)
