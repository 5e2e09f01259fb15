"""Ragged-batch bookkeeping shared by the kernels: which request and position each packed token has.

A step packs the query tokens of all requests into one `[T, ...]` array: request `s` owns tokens
`[cu_q_lens[s], cu_q_lens[s+1])`, and they are the LAST `q_len` positions of its `kv_len` tokens,
so packed token `t` of request `s` sits at absolute position `t + kv_lens[s] - cu_q_lens[s+1]`.
Rows `s >= num_seqs` and tokens `t >= cu_q_lens[num_seqs]` are padding.
All values are traced (they change every step); only shapes are static.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def check_ragged_metadata(
    page_table: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array
) -> None:
    """ValueError unless page_table is int [S, max_pages], kv_lens int [S], cu_q_lens int [S+1]
    and num_seqs int [1] (the ragged-batch contract both kernels share)."""
    if page_table.ndim != 2 or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"{page_table.shape=} ({page_table.dtype}) must be int [S, max_pages]")
    s = page_table.shape[0]
    for name, arr, shape in (
        ("kv_lens", kv_lens, (s,)),
        ("cu_q_lens", cu_q_lens, (s + 1,)),
        ("num_seqs", num_seqs, (1,)),
    ):
        if arr.shape != shape or not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(
                f"{name}.shape={arr.shape} ({arr.dtype}) must be int {shape} for {page_table.shape=}"
            )


class TokenLayout(NamedTuple):
    """Per packed token: request row, absolute position, and whether it is a real token.

    seq i32[T] (clamped into [0, S)), pos i32[T], valid bool[T], chunk_start i32[T] (absolute
    position of the first token of this step's chunk of that request).
    """

    seq: jax.Array
    pos: jax.Array
    valid: jax.Array
    chunk_start: jax.Array


def sanitize(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, max_kv_len: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Clamp traced metadata so garbage in padding rows can never index out of bounds.

    Returns (cu i32[S+1] non-decreasing in [0, T] and constant after num_seqs, kv i32[S] in
    [0, max_kv_len], q_len i32[S] zero for padding rows).
    """
    s = kv_lens.shape[0]
    n = jnp.clip(num_seqs.reshape(-1)[0].astype(jnp.int32), 0, s)
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)
    cu = jax.lax.cummax(cu, axis=0)
    # Freeze the prefix sum after the last live request so padding rows own no tokens.
    cu = jnp.where(jnp.arange(s + 1) <= n, cu, cu[n])
    kv = jnp.clip(kv_lens.astype(jnp.int32), 0, max_kv_len)
    q_len = cu[1:] - cu[:-1]
    return cu, kv, q_len


def token_layout(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, max_kv_len: int
) -> TokenLayout:
    """Map each of the `num_tokens` packed tokens to (request, absolute position, validity)."""
    cu, kv, _ = sanitize(cu_q_lens, kv_lens, num_seqs, num_tokens, max_kv_len)
    s = kv.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # Number of request ends <= t is the request index owning t.
    seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    valid = seq < s
    seq = jnp.minimum(seq, s - 1)
    end = cu[seq + 1]
    valid = valid & (t >= cu[seq]) & (t < end)
    pos = t + kv[seq] - end
    chunk_start = kv[seq] - (end - cu[seq])
    valid = valid & (pos >= 0)
    return TokenLayout(seq=seq, pos=pos, valid=valid, chunk_start=chunk_start)
