"""The debug-mode page-table mirror checker (DESIGN §6).

Debug mode feeds a mirror with nothing but StepOps through the oracle
(`scheduler.page_table_oracle`) and checks it against the scheduler's authoritative rows after
every schedule; a second, tail-only mirror counts how often the seed's aliasing bug would have
struck.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scheduler.page_table_oracle import apply_group_ops
from scheduler.step_ops import GroupLayout, StepOps


class MirrorChecker:
    """Debug mode: an exact mirror and a tail-only mirror of every group's page table
    (i32[num_slots, width]), checked after every schedule."""

    def __init__(self, layouts: Sequence[GroupLayout], num_slots: int) -> None:
        self.exact = [np.zeros((num_slots, lay.width), np.int32) for lay in layouts]
        self.tail_only = [np.zeros((num_slots, lay.width), np.int32) for lay in layouts]
        self.tail_only_divergences = 0

    def apply(self, ops: StepOps, rows: dict[int, list[list[int]]]) -> None:
        """Apply one step's updates to both mirrors, then assert that the exact one holds
        `rows` (slot -> per-group page rows, the scheduler's authoritative rows after planning
        `ops`) in every slot the step touches; count the slots where the tail-only one does not."""
        for g, gops in enumerate(ops.groups):
            clamped = apply_group_ops(self.exact[g], ops, gops)
            assert not clamped, (
                f"group {g}: rows of {[ops.request_ids[i] for i in clamped]} "
                f"outgrow the mirror width {self.exact[g].shape[1]}"
            )
            apply_group_ops(self.tail_only[g], ops, gops, honor_full_refresh=False)
        for i in range(ops.num_seqs):
            slot = int(ops.req_slots[i])
            for g, row in enumerate(rows[slot]):
                exact = self.exact[g][slot]
                assert list(exact[: len(row)]) == row and not exact[len(row) :].any(), (
                    f"mirror of {ops.request_ids[i]!r} group {g} diverged: {list(exact[: len(row)])} != {row}"
                )
                if list(self.tail_only[g][slot, : len(row)]) != row:
                    self.tail_only_divergences += 1
