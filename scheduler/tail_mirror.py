"""A numpy twin of the device page-table mirror, for debug checks and tests (DESIGN.md §6).

`apply_group_ops` is the host reference of the runtime's `update_rows` (+ hole columns): it lets
the scheduler verify in debug mode that a mirror fed only with StepOps equals its authoritative
rows, and counts how often a tail-only mirror (the seed's aliasing bug) would have diverged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from scheduler.step_ops import GroupStepOps, StepOps

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def apply_group_ops(mirror: np.ndarray, ops: StepOps, gops: GroupStepOps, *,
                    honor_full_refresh: bool = True) -> list[int]:
    """Apply one group's update to `mirror` (i32[slots, W]) in place; returns clamped rows."""
    width = mirror.shape[1]
    clamped = []
    for i in range(ops.num_seqs):
        slot = int(ops.req_slots[i])
        if slot < 0:
            continue
        if honor_full_refresh and ops.full_refresh[i]:
            n = int(gops.row_lens[i])
            copy = min(n, width)
            mirror[slot, :copy] = gops.rows[i, :copy]
            mirror[slot, copy:] = 0
            if n > width:
                clamped.append(i)
            continue
        begin, size = int(gops.begins[i]), int(gops.sizes[i])
        copy = max(0, min(size, width - begin))
        if copy < size:
            clamped.append(i)
        if copy:
            mirror[slot, begin:begin + copy] = gops.new_pages[i, :copy]
        holes = gops.hole_slots[i]
        holes = holes[holes < width]
        mirror[slot, holes] = 0
    return clamped


class MirrorChecker:
    """Debug mode: an exact mirror and a tail-only mirror, checked after every schedule."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        slots = scheduler.config.num_live_slots
        self.exact = [np.zeros((slots, lay.width), np.int32) for lay in scheduler.layouts]
        self.tail_only = [np.zeros((slots, lay.width), np.int32) for lay in scheduler.layouts]
        self.tail_only_divergences = 0

    def apply(self, ops: StepOps) -> None:
        rows = self.scheduler.authoritative_rows()
        for g, gops in enumerate(ops.groups):
            apply_group_ops(self.exact[g], ops, gops)
            apply_group_ops(self.tail_only[g], ops, gops, honor_full_refresh=False)
        for i in range(ops.num_seqs):
            slot = int(ops.req_slots[i])
            for g, row in enumerate(rows[slot]):
                exact = self.exact[g][slot]
                assert list(exact[:len(row)]) == row and not exact[len(row):].any(), (
                    f"mirror of {ops.request_ids[i]!r} group {g} diverged: "
                    f"{list(exact[:len(row)])} != {row}")
                if list(self.tail_only[g][slot, :len(row)]) != row:
                    self.tail_only_divergences += 1
