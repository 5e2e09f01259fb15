"""The paged plumbing every recurrent token mixer shares (Gated DeltaNet, Mamba2): where a row's
state comes from, its short causal conv over a packed step, and where its new state goes.

A state-group layer keeps two pools, one snapshot per page id: the recurrence's state
(`"ssm"`, f32[P, ...]) and the conv tail (`"conv_state"`, f32[P, K-1, C]: the row's last K-1 conv
inputs, oldest first). A row starts from `batch.state_read[g]` (the page of its last cached token)
when it has cached tokens, else from zeros, and leaves its final state at `batch.state_write[g]`
(the page of its last token this step; num_pages = dropped). Every page a step completes also
gets the state after its last token (`snapshot_plan`: the recurrence runs in chunks aligned to
page boundaries and writes each page-end state), so the prefix cache can resume a later request
at any page boundary, as it does for attention pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokenspeed_jax.models.batch import PagedBatch


def read_states(cache: dict, batch: PagedBatch, group: int) -> tuple[jax.Array, jax.Array]:
    """Each row's starting (state f32[R, ...], conv tail f32[R, K-1, C]); zeros for rows with
    nothing cached (fresh prompts, padding rows)."""
    cu, kv_lens = batch.cu_q_lens, batch.kv_lens
    r = kv_lens.shape[0]
    q_lens = cu[1:] - cu[:-1]
    has_init = (jnp.arange(r) < batch.num_seqs[0]) & (q_lens > 0) & (kv_lens - q_lens > 0)
    read = batch.state_read[group]
    ssm, tail = cache["ssm"][read], cache["conv_state"][read]
    # where(), not a product: an unused or null page may hold anything, NaN included
    ssm = jnp.where(has_init.reshape((r,) + (1,) * (ssm.ndim - 1)), ssm, 0.0)
    return ssm, jnp.where(has_init[:, None, None], tail, 0.0)


def conv_windows(mixed: jax.Array, tail0: jax.Array, cu_q_lens: jax.Array, kernel: int) -> jax.Array:
    """Conv inputs mixed f32[T, C] of a packed step + each row's old tail f32[R, K-1, C] ->
    every token's window f32[T, K, C] (oldest first): taps inside the row's chunk come from
    `mixed`, earlier ones from the row's tail."""
    t, r = mixed.shape[0], tail0.shape[0]
    rows = jnp.clip(jnp.searchsorted(cu_q_lens[1:], jnp.arange(t), side="right"), 0, r - 1)
    j = jnp.arange(t) - cu_q_lens[rows]  # index of the token in its row's chunk
    taps = []
    for d in range(kernel - 1, -1, -1):  # tap of the input d tokens back
        inside = mixed[jnp.clip(jnp.arange(t) - d, 0, t - 1)]
        from_tail = tail0[rows, jnp.clip(kernel - 1 + j - d, 0, kernel - 2)] if kernel > 1 else inside
        taps.append(jnp.where((j >= d)[:, None], inside, from_tail))
    return jnp.stack(taps, axis=1)


def dense_windows(mixed: jax.Array, kernel: int) -> jax.Array:
    """One whole sequence's conv windows f32[S, K, C] from zeros (the dense forward)."""
    s = mixed.shape[0]
    padded = jnp.pad(mixed, ((kernel - 1, 0), (0, 0)))
    return jnp.stack([padded[j : j + s] for j in range(kernel)], axis=1)


def snapshot_plan(
    batch: PagedBatch, group: int, pool_pages: int, max_chunk: int
) -> tuple[int, jax.Array, jax.Array]:
    """(chunk size c, align i32[R], page-end pages i32[T]) for `ragged_scan`'s page snapshots:
    c = the largest divisor of the page size <= max_chunk, so chunk ends aligned to positions
    `k * c` meet every page end; align = each row's first position mod c; pages[t] = the page
    of token t when t is the last token of its page, else `pool_pages` (none). `pool_pages` is
    the pool's length (n * num_pages under the layer scan, whose shifted write_idx it matches)."""
    b = batch.page_sizes[group]
    c = max(d for d in range(1, min(b, max_chunk) + 1) if b % d == 0)
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    align = (batch.kv_lens - q_lens) % c
    w = batch.write_idx[group]
    pages = jnp.where((w < pool_pages * b) & (w % b == b - 1), w // b, pool_pages)
    return c, align, pages


def store_states(
    cache: dict,
    batch: PagedBatch,
    group: int,
    ssm_pool: jax.Array | None,
    ssm: jax.Array,
    windows: jax.Array,
    tail0: jax.Array,
    pages: jax.Array,
) -> dict:
    """The pools after a step: ssm_pool (the state pool with the page-end snapshots the kernel
    wrote; None: cache["ssm"]) plus each row's final state f32[R, ...] at its `state_write`
    page. The conv tail after token t is its window's newest K-1 inputs (windows f32[T, K, C]),
    stored at page ends (`pages`, from `snapshot_plan`) and, for each row, after its last token
    (a row without tokens keeps tail0). Dropped rows / tokens index past the pool."""
    tails = windows[:, 1:]
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    last = jnp.clip(batch.cu_q_lens[1:] - 1, 0, windows.shape[0] - 1)
    row_tails = jnp.where((q_lens > 0)[:, None, None], tails[last], tail0)
    write = batch.state_write[group]
    conv = cache["conv_state"].at[pages].set(tails.astype(cache["conv_state"].dtype), mode="drop")
    return {
        "ssm": (cache["ssm"] if ssm_pool is None else ssm_pool).at[write].set(ssm, mode="drop"),
        "conv_state": conv.at[write].set(row_tails, mode="drop"),
    }
