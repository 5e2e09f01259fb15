"""Functional device page-table mirror update (DESIGN.md §6).

The device keeps, per cache group, `mirror: i32[max_live_requests, W]`, a copy of the scheduler's
rows. Each step applies the group's `GroupStepOps`:

* rows with `full_refresh` are rewritten whole from column 0 with the authoritative row, and every
  column past `row_len` is reset to the null page 0 (no stale id survives a refresh: the seed's
  aliasing bug came from refreshing only the tail after adoption repointed an earlier slot);
* other rows get their tail delta `new_pages[i, :sizes[i]]` written at `begins[i]`;
* columns past the mirror width are dropped (capacity clamp; `add_request` admits no request whose
  row can outgrow the width; the runner warns naming any request that does (hand-built ops),
  and debug mode asserts it never happens on the numpy oracle
  `scheduler.page_table_oracle.update_rows_reference`, which tests compare this function against);
* `hole_slots` columns are set to 0 (slots reclaimed into holes this step).

Everything is fixed-shape and mask based. The tail path is an element scatter whose cost is
O(rows * delta_width), independent of the context length; the full-row path costs O(rows * W) and
runs (via `lax.cond`) only on steps that actually carry a full refresh, so pure decode steps do
not pay for long contexts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["update_rows", "apply_holes"]


@functools.partial(jax.jit, static_argnames=("honor_full_refresh",))
def update_rows(
    table: jax.Array,
    req_slots: jax.Array,
    begins: jax.Array,
    sizes: jax.Array,
    new_pages: jax.Array,
    full_refresh: jax.Array,
    rows: jax.Array,
    row_lens: jax.Array,
    honor_full_refresh: bool = True,
    hole_slots: jax.Array | None = None,
) -> jax.Array:
    """Returns the mirror after one step's update (SPEC.md `update_rows`).

    Args:
      table: i32[S, W] the mirror of one cache group (S device slots).
      req_slots: i32[B] device slot of each batch row; -1 (or any out-of-range value) = padding.
      begins, sizes: i32[B] tail delta: first column and number of valid `new_pages` entries.
      new_pages: i32[B, N] tail-delta page ids.
      full_refresh: bool[B] rewrite the row from column 0 with `rows[i, :row_lens[i]]`.
      rows: i32[B, W2] authoritative rows (W2 may differ from W; extra columns are clamped).
      row_lens: i32[B] valid entries of `rows`.
      honor_full_refresh: False treats refresh rows as plain tail deltas (reproduces the
        tail-only mirror, i.e. the aliasing bug) -- for experiments only.
      hole_slots: optional i32[B, M] columns to reset to 0 on each row; W (or larger) = padding.
    Returns:
      i32[S, W] the updated mirror (a new array; donate `table` to update in place).
    """
    num_slots, width = table.shape
    req_slots = req_slots.astype(jnp.int32)
    valid = (req_slots >= 0) & (req_slots < num_slots)
    slot_idx = jnp.where(valid, req_slots, num_slots)  # out of range -> dropped
    refresh = valid & full_refresh.astype(bool) if honor_full_refresh else jnp.zeros_like(valid)

    # Tail deltas (element scatter, O(B * N)).
    n = new_pages.shape[1]
    k = jnp.arange(n, dtype=jnp.int32)[None, :]
    cols = begins.astype(jnp.int32)[:, None] + k
    keep = (valid & ~refresh)[:, None] & (k < sizes[:, None]) & (cols >= 0) & (cols < width)
    t_rows = jnp.where(keep, slot_idx[:, None], num_slots)
    t_cols = jnp.where(keep, cols, width)
    table = table.at[t_rows, t_cols].set(new_pages.astype(table.dtype), mode="drop")

    # Full refresh (row scatter, O(B * W)); skipped at run time on steps without any refresh.
    def _refresh(tab):
        w2 = rows.shape[1]
        if w2 >= width:
            src = rows[:, :width]
        else:
            src = jnp.pad(rows, ((0, 0), (0, width - w2)))
        col = jnp.arange(width, dtype=jnp.int32)[None, :]
        new_rows = jnp.where(col < row_lens[:, None], src, 0).astype(tab.dtype)
        r_idx = jnp.where(refresh, slot_idx, num_slots)
        return tab.at[r_idx].set(new_rows, mode="drop")

    if honor_full_refresh:
        table = jax.lax.cond(jnp.any(refresh), _refresh, lambda tab: tab, table)

    if hole_slots is not None:
        table = apply_holes(table, req_slots, hole_slots)
    return table


def apply_holes(table: jax.Array, req_slots: jax.Array, hole_slots: jax.Array) -> jax.Array:
    """Sets columns `hole_slots[i, :]` of row `req_slots[i]` to the null page 0.

    table i32[S, W]; req_slots i32[B] (-1 padding); hole_slots i32[B, M] with W = padding.
    Column indices outside [0, W) and padding rows are dropped.
    """
    num_slots, width = table.shape
    req_slots = req_slots.astype(jnp.int32)
    valid = (req_slots >= 0) & (req_slots < num_slots)
    hole_slots = hole_slots.astype(jnp.int32)
    keep = valid[:, None] & (hole_slots >= 0) & (hole_slots < width)
    h_rows = jnp.where(keep, req_slots[:, None], num_slots)
    h_cols = jnp.where(keep, hole_slots, width)
    return table.at[h_rows, h_cols].set(0, mode="drop")
