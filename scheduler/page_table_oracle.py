"""The numpy oracle of the page-table update rule (DESIGN §6).

`update_rows_reference` is the one host statement of the rule the device implements with
`tokenspeed_jax.page_table.update_rows` (tests compare the two); `clamped_rows` finds the rows
whose update outgrows the table (the runtime checks every step with it); `apply_group_ops` feeds
one cache group's mirror from a StepOps (the debug mirror checker and the tests' fake devices).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from scheduler.step_ops import GroupStepOps, StepOps


def update_rows_reference(
    table: np.ndarray,
    req_slots: ArrayLike,
    begins: ArrayLike,
    sizes: ArrayLike,
    new_pages: ArrayLike,
    full_refresh: ArrayLike,
    rows: ArrayLike,
    row_lens: ArrayLike,
    honor_full_refresh: bool = True,
    hole_slots: ArrayLike | None = None,
) -> list[int]:
    """Applies one step's update to `table` (i32[S, W]) IN PLACE, one batch row at a time.

    Arguments as SPEC.md `update_rows` (req_slots i32[B], -1 or >= S = padding; new_pages
    i32[B, N]; rows i32[B, W2]; hole_slots i32[B, M], columns outside [0, W) = padding):
    - full refresh (when honored): the row becomes `rows[i, :row_lens[i]]` from column 0 and
      zeros after it, so no stale id survives;
    - otherwise the tail delta `new_pages[i, :sizes[i]]` is written at column `begins[i]`;
    - then the `hole_slots` columns become the null page 0.
    Writes past column W are dropped (the device's capacity clamp). Returns the batch rows that
    lost such writes: `add_request` admits no request whose row can outgrow W, so debug mode
    asserts this list is empty.
    """
    num_slots, width = table.shape
    new, full = np.asarray(new_pages), np.asarray(rows)
    refresh = (np.asarray(full_refresh, bool) & honor_full_refresh).tolist()
    starts, counts, lens = (np.asarray(a).tolist() for a in (begins, sizes, row_lens))
    for i, slot in enumerate(np.asarray(req_slots).tolist()):
        if not 0 <= slot < num_slots:
            continue  # padding row
        if refresh[i]:
            size = max(0, min(lens[i], full.shape[1]))
            table[slot] = 0
            table[slot, : min(size, width)] = full[i, : min(size, width)]
        else:
            begin, size = starts[i], max(0, min(counts[i], new.shape[1]))
            cols = np.arange(begin, begin + size)
            keep = (cols >= 0) & (cols < width)
            table[slot, cols[keep]] = new[i, :size][keep]
        if hole_slots is not None:
            holes = np.asarray(hole_slots)[i]
            table[slot, holes[(holes >= 0) & (holes < width)]] = 0
    over = clamped_rows(
        req_slots,
        begins,
        np.minimum(np.asarray(sizes), new.shape[1]),
        full_refresh,
        np.minimum(np.asarray(row_lens), full.shape[1]),
        width,
        honor_full_refresh,
        num_slots,
    )
    return [int(i) for i in over]


def clamped_rows(
    req_slots: ArrayLike,
    begins: ArrayLike,
    sizes: ArrayLike,
    full_refresh: ArrayLike,
    row_lens: ArrayLike,
    width: int,
    honor_full_refresh: bool = True,
    num_slots: int | None = None,
) -> np.ndarray:
    """Batch rows (int64[k]) whose update does not fit a mirror of `width` columns: after the
    full-refresh substitution (begin 0, size row_len), `begin + size > width` (DESIGN §6 rule 3).

    The device copies only `max(0, width - begin)` of their pages; the runner logs a warning
    naming each such request. Vectorised, so it is cheap enough to run on every step.
    """
    slots = np.asarray(req_slots)
    refresh = np.asarray(full_refresh, dtype=bool) & honor_full_refresh
    begin = np.where(refresh, 0, np.asarray(begins))
    size = np.maximum(np.where(refresh, np.asarray(row_lens), np.asarray(sizes)), 0)
    live = (slots >= 0) if num_slots is None else (slots >= 0) & (slots < num_slots)
    return np.flatnonzero(live & (size > 0) & (begin + size > width))


def apply_group_ops(
    mirror: np.ndarray, ops: StepOps, gops: GroupStepOps, *, honor_full_refresh: bool = True
) -> list[int]:
    """`update_rows_reference` on one cache group's mirror, fed from a StepOps."""
    return update_rows_reference(
        mirror,
        ops.req_slots,
        gops.begins,
        gops.sizes,
        gops.new_pages,
        ops.full_refresh,
        gops.rows,
        gops.row_lens,
        honor_full_refresh,
        gops.hole_slots,
    )
