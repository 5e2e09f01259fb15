"""`BlockTable`: the logical page row of one request in one cache group (DESIGN.md §2)."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """Pages of `b` tokens needed to hold `a` tokens (exact integer ceil)."""
    return -(-a // b)


class BlockTable:
    """Slot `i` covers tokens `[i*B, (i+1)*B)`; page id 0 marks a hole.

    Tables never shrink and are never compacted, so holes keep slot alignment. `tail_avail` is
    the unused token capacity of the last slot; `reclaim_floor` bounds reclaim scans from below
    (every slot under it is already a hole or will never be reclaimed by this table).
    `num_published` is the publish cursor: slots below it were already offered to the prefix cache.
    """

    __slots__ = ("pages", "tail_avail", "reclaim_floor", "num_published")

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.tail_avail = 0
        self.reclaim_floor = 0
        self.num_published = 0

    def page_ids(self) -> list[int]:
        """The absolute row (a copy): page id per slot, 0 for holes."""
        return list(self.pages)

    @property
    def num_blocks(self) -> int:
        return len(self.pages)

    def extent_tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size - self.tail_avail

    def reset(self) -> None:
        self.pages = []
        self.tail_avail = 0
        self.reclaim_floor = 0
        self.num_published = 0

    def __repr__(self) -> str:
        return (
            f"BlockTable(pages={self.pages}, tail_avail={self.tail_avail}, "
            f"reclaim_floor={self.reclaim_floor})"
        )
