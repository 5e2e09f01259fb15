"""`PagedBatch`: per-step device metadata the paged forward reads (built by the runner)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """Packed-token step metadata. T = token bucket, R = batch rows, g = cache group.

    positions i32[T] absolute position of each token (0 on padding).
    kv_lens i32[R]; cu_q_lens i32[R+1]; num_seqs i32[1] (kernel contract, SPEC.md).
    page_tables[g] i32[R, C_g]: the first C_g columns of the batch's mirror rows
      (`mirror[g][req_slots, :C_g]`; C_g = the step's kv columns, see `make_paged_batch`).
    write_idx[g] i32[T]: flat pool index `page * B_g + pos % B_g` of each token, or the
      out-of-range `P_g * B_g` (dropped) for padding and holes; P_g = the page ids of group
      g's pool (`num_pages`, or a state pool's `state_pages`).
    state_read[g] i32[R]: the page holding the recurrent state a state group's row starts this
      step from (the page of its last cached token), or 0 when the row starts from zeros
      (nothing cached) or is padding.
    state_write[g] i32[R]: the page taking the row's state after this step (the page of its
      last token), or `P_g` (dropped) for padding / a row without tokens / a hole.
    layer_groups (static): cache-group index of each layer.
    page_sizes (static): tokens per page of each group.
    """

    positions: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    page_tables: tuple[jax.Array, ...]
    write_idx: tuple[jax.Array, ...]
    state_read: tuple[jax.Array, ...]
    state_write: tuple[jax.Array, ...]
    layer_groups: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    page_sizes: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))


def make_paged_batch(
    mirrors: tuple[jax.Array, ...],
    req_slots: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    positions: jax.Array,
    token_rows: jax.Array,
    *,
    page_sizes: tuple[int, ...],
    num_pages: int,
    layer_groups: tuple[int, ...],
    kv_cols: tuple[int, ...] | None = None,
    group_pages: tuple[int, ...] | None = None,
) -> PagedBatch:
    """Derives the step metadata ON DEVICE from the (already updated) mirrors.

    mirrors[g] i32[S, W_g]; req_slots i32[R] (-1 padding); cu_q_lens i32[R+1]; kv_lens i32[R];
    positions, token_rows i32[T] (token_rows = R on padding). The write location of token t in
    group g is `page = mirrors[g][slot, pos // B_g]` (architecture.md), so a stale mirror really
    writes to the wrong page; holes (page 0), padding and columns past W_g drop their writes.
    kv_cols[g] (static; None = W_g): columns of the read page tables. Every position a step reads
    is below its row's kv_len, so the caller's kv bucket (covering the longest row) loses nothing;
    writes still address the whole mirror. group_pages[g] (static; None = num_pages for every
    group): the page ids of group g's pool, whose length is its drop index.
    """
    r = req_slots.shape[0]
    token_valid = (token_rows >= 0) & (token_rows < r)
    row = jnp.clip(token_rows, 0, r - 1)
    slot_ok = req_slots >= 0
    tables, write_idx, state_read, state_write = [], [], [], []
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    starts = kv_lens - q_lens  # tokens cached before this step
    live = slot_ok & (q_lens > 0)
    for g, mirror in enumerate(mirrors):
        num_slots, width = mirror.shape
        b = page_sizes[g]
        drop = num_pages if group_pages is None else group_pages[g]
        slots = jnp.clip(req_slots, 0, num_slots - 1)
        cols = width if kv_cols is None else min(width, kv_cols[g])
        tables.append(jnp.where(slot_ok[:, None], mirror[:, :cols][slots], 0))
        col = positions // b
        page = mirror[slots[row], jnp.minimum(col, width - 1)]
        ok = token_valid & slot_ok[row] & (col < width) & (page != 0)
        write_idx.append(jnp.where(ok, page * b + positions % b, drop * b))
        # state groups: one snapshot per page, that of the page's last token
        read = mirror[slots, jnp.clip((starts - 1) // b, 0, width - 1)]
        state_read.append(jnp.where(live & (starts > 0), read, 0))
        wcol = (kv_lens - 1) // b
        wpage = mirror[slots, jnp.clip(wcol, 0, width - 1)]
        state_write.append(jnp.where(live & (wcol < width) & (wpage != 0), wpage, drop))
    return PagedBatch(
        positions=positions,
        kv_lens=jnp.where(slot_ok, kv_lens, 0),
        cu_q_lens=cu_q_lens,
        num_seqs=jnp.sum(slot_ok, dtype=jnp.int32)[None],
        page_tables=tuple(tables),
        write_idx=tuple(write_idx),
        state_read=tuple(state_read),
        state_write=tuple(state_write),
        layer_groups=layer_groups,
        page_sizes=tuple(page_sizes),
    )
