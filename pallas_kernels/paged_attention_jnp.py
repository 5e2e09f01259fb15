"""`paged_attention_reference`: the pure-jnp twin of the Pallas paged-attention kernel, and the
runtime's CPU backend (XLA:CPU runs it; its cost follows the step's real tokens and context).

Two passes over a step's requests, each a loop whose trip count is traced (padding tokens and
the static bound's surplus cost nothing):
- tokens of short requests (<= `PER_TOKEN_MAX_Q` query tokens: decodes, short drafts), a
  chunk of `TOKENS_PER_CHUNK` tokens at a time; an inner loop walks their pages
  `PAGES_PER_STEP` at a time with an online softmax, up to the chunk's longest context (not the
  kv bucket's width). Each token gathers only its own pages, a few KiB per step, in cache;
- blocks of `REFERENCE_BLOCK_Q` query tokens of one longer request (prefill chunks), a block
  gathering its request's K/V (`page_table` columns = the step's kv bucket) once.
Same math either way: float32 logits and softmax, NaN-safe masks (`jnp.where` on logits AND
values: NaN * 0 = NaN) over `[max(0, pos - W + 1), pos]`; fully masked rows come out as zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kv_quant, pool_bits
from pallas_kernels.paged_attention_inputs import block_metadata, check_inputs

__all__ = [
    "PAGES_PER_STEP",
    "PER_TOKEN_MAX_Q",
    "REFERENCE_BLOCK_Q",
    "TOKENS_PER_CHUNK",
    "BlocksPass",
    "TokensPass",
    "pad_meta",
    "paged_attention_reference",
]

# Requests with at most this many query tokens go token by token: a block of
# `REFERENCE_BLOCK_Q` rows would compute mostly padding rows for them.
PER_TOKEN_MAX_Q = 4
# Query tokens per block of a longer request: its K/V is gathered once per block. 32 beat 16
# and 64 on SmolLM2 shapes (a 512-token chunk at kv 512 / 2048, docs/performance.md).
REFERENCE_BLOCK_Q = 32
# Token pass: tokens per outer iteration and pages per inner step. SmolLM2 shapes, 32 decodes
# at ~380 tokens of context: 2 / 4 / 8 pages x 16 / 32 tokens, einsums or multiply-reduce, all
# within 3.5-5.5 ms a layer (noise-level differences); 1 page per step was slower.
TOKENS_PER_CHUNK = 16
PAGES_PER_STEP = 2


def _gather(pool: jax.Array, scales: jax.Array | None, pages: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """f32 K or V rows of `pages` (float pool, or quantized values times their scales)."""
    vals = kv_quant.value_dtype(pool.dtype)
    if scales is None or vals is None:
        return pool_bits.take(pool, pages, dtype).astype(jnp.float32)
    return kv_quant.dequantize(
        pool_bits.take(pool, pages, vals), pool_bits.take(scales, pages, kv_quant.SCALE_DTYPE)
    )


def pad_meta(meta: jax.Array, num_blocks: int, multiple: int, t: int) -> tuple[jax.Array, int]:
    """The first `num_blocks` blocks, padded with empty ones ([T, T) of request 0) to a
    multiple of `multiple`."""
    num_blocks += -num_blocks % multiple
    if meta.shape[1] >= num_blocks:
        meta = meta[:, :num_blocks]
    else:
        meta = jnp.pad(meta, ((0, 0), (0, num_blocks - meta.shape[1])), constant_values=t)
    return meta.at[0].set(jnp.where(meta[1] < meta[2], meta[0], 0)), num_blocks


def _tokens_pass(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    meta: jax.Array,
    num_blocks: int,
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: jax.Array | None,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """One-token blocks `meta` i32[4, NB] -> (out f[NB, Hq, D], dest i32[NB], T = none)."""
    t, hq, d = q.shape
    _, page_size, hkv, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group = hq // hkv
    c, pps = TOKENS_PER_CHUNK, PAGES_PER_STEP
    meta, num_blocks = pad_meta(meta, num_blocks, c, t)
    ok = meta[1] < meta[2]
    pos = jnp.where(ok, meta[1] + meta[3], -1)  # absolute position of each token
    first = (
        jnp.zeros_like(pos)
        if sliding_window is None
        else jnp.maximum(pos - sliding_window + 1, 0) // page_size
    )
    steps = jnp.where(ok, (pos // page_size - first + pps) // pps, 0)  # page steps per token
    qg = q[jnp.minimum(meta[1], t - 1)].astype(jnp.float32).reshape(num_blocks, hkv, group, d)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(hkv, group)
    kk = jnp.arange(pps * page_size, dtype=jnp.int32)

    def chunk(i: jax.Array, outs: jax.Array) -> jax.Array:
        def sl(x: jax.Array) -> jax.Array:
            return lax.dynamic_slice_in_dim(x, i * c, c, axis=0)

        seq, pos_c, first_c, q_c = sl(meta[0]), sl(pos), sl(first), sl(qg)
        table = page_table[seq].astype(jnp.int32)  # [C, max_pages]

        def step(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            m, den, acc = carry
            cols = first_c[:, None] + j * pps + jnp.arange(pps, dtype=jnp.int32)  # [C, pps]
            pages = jnp.take_along_axis(table, jnp.minimum(cols, max_pages - 1), axis=1)
            k = _gather(k_pages, k_scales, pages, q.dtype).reshape(c, -1, hkv, d)
            v = _gather(v_pages, v_scales, pages, q.dtype).reshape(c, -1, hkv, d)
            kpos = (first_c[:, None] + j * pps) * page_size + kk[None, :]  # [C, L]
            keep = (kpos <= pos_c[:, None]) & (kpos < max_pages * page_size)
            if sliding_window is not None:
                keep = keep & (kpos > pos_c[:, None] - sliding_window)
            v = jnp.where(keep[:, :, None, None], v, 0.0)
            lg = jnp.einsum("chgd,clhd->chgl", q_c, k, precision=lax.Precision.HIGHEST) * scale
            if soft_cap is not None:
                lg = soft_cap * jnp.tanh(lg / soft_cap)
            lg = jnp.where(keep[:, None, None, :], lg, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(lg, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(lg - m_safe[..., None])
            corr = jnp.exp(m - m_safe)  # m = -inf (nothing seen yet): 0
            pv = jnp.einsum("chgl,clhd->chgd", p, v, precision=lax.Precision.HIGHEST)
            return m_new, den * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

        shape = (c, hkv, group)
        if sink is None:  # running max, denominator, numerator
            init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, d)))
        else:  # a sink is a key with logit `sink` and value 0 seen first
            init = (jnp.broadcast_to(sink, shape), jnp.ones(shape), jnp.zeros((*shape, d)))
        _, den, acc = lax.fori_loop(0, jnp.max(sl(steps)), step, init)
        o = acc / jnp.where(den > 0, den, 1.0)[..., None]
        o = jnp.where(sl(ok)[:, None, None], o.reshape(c, hq, d), 0.0).astype(q.dtype)
        return lax.dynamic_update_slice_in_dim(outs, o, i * c, axis=0)

    n_real = jnp.sum(ok)  # real tokens are a prefix of the list
    outs = lax.fori_loop(0, (n_real + c - 1) // c, chunk, jnp.zeros((num_blocks, hq, d), q.dtype))
    return outs, jnp.where(ok, meta[1], t)


def _blocks_pass(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    meta: jax.Array,
    num_blocks: int,
    *,
    bq: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: jax.Array | None,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
    max_gather_elems: int,
) -> tuple[jax.Array, jax.Array]:
    """Blocks `meta` i32[4, NB] of up to `bq` tokens of one request -> (out f[NB * bq, Hq, D],
    dest i32[NB * bq]: packed token index of each row, T = none)."""
    t, hq, d = q.shape
    _, page_size, hkv, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group = hq // hkv
    if sliding_window is None:
        n_cols = max_pages
    else:
        n_cols = min(max_pages, (sliding_window + bq - 2 + page_size - 1) // page_size + 1)
    span = n_cols * page_size
    batch = max(1, min(num_blocks, max_gather_elems // max(1, span * hkv * d)))
    meta, num_blocks = pad_meta(meta, num_blocks, batch, t)
    sink_logits = None if sinks is None else sinks.astype(jnp.float32).reshape(1, hkv, group, 1)
    rows = jnp.arange(bq, dtype=jnp.int32)
    kk = jnp.arange(span, dtype=jnp.int32)

    def one(m: jax.Array) -> jax.Array:
        seq, q0, q1, pos_off = m[0], m[1], m[2], m[3]
        tok = q0 + rows
        ok = tok < q1  # [bq] real query rows of this block
        qpos = tok + pos_off
        first: jax.Array | int = 0
        if sliding_window is not None:
            first = jnp.maximum(q0 + pos_off - sliding_window + 1, 0) // page_size
        cols = first + jnp.arange(n_cols, dtype=jnp.int32)
        pages = page_table[seq, jnp.minimum(cols, max_pages - 1)].astype(jnp.int32)
        kpos = first * page_size + kk  # [L] absolute key positions
        keep = ok[:, None] & (kpos[None, :] <= qpos[:, None]) & (kpos < max_pages * page_size)[None, :]
        if sliding_window is not None:
            keep = keep & (kpos[None, :] > qpos[:, None] - sliding_window)
        # uint16 pools hold bf16 / f16 bits (pool_bits): only the gathered pages are bitcast;
        # a quantized cache is dequantized the same way, gathered pages only
        k = _gather(k_pages, k_scales, pages, q.dtype).reshape(span, hkv, d)
        v = _gather(v_pages, v_scales, pages, q.dtype).reshape(span, hkv, d)
        v = jnp.where(jnp.any(keep, axis=0)[:, None, None], v, 0.0)  # NaN * 0 = NaN
        qg = q[jnp.minimum(tok, t - 1)].astype(jnp.float32).reshape(bq, hkv, group, d)
        logits = jnp.einsum("qhgd,lhd->qhgl", qg, k, precision=lax.Precision.HIGHEST) * scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(keep[:, None, None, :], logits, -jnp.inf)
        if sink_logits is not None:
            logits = jnp.concatenate([logits, jnp.broadcast_to(sink_logits, (bq, hkv, group, 1))], axis=-1)
        mx = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.exp(logits - jnp.where(jnp.isfinite(mx), mx, 0.0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("qhgl,lhd->qhgd", p[..., :span], v, precision=lax.Precision.HIGHEST)
        o = o / jnp.where(denom > 0, denom, 1.0)
        return jnp.where(ok[:, None, None], o.reshape(bq, hq, d), 0.0).astype(q.dtype)

    def body(i: jax.Array, outs: jax.Array) -> jax.Array:
        m = lax.dynamic_slice_in_dim(meta, i * batch, batch, axis=1)
        return lax.dynamic_update_slice_in_dim(outs, jax.vmap(one)(m.T), i * batch, axis=0)

    # A vmap over the static bound computed every block: 4x the work of a 512-token chunk at
    # S = 64 (the bound's S surplus blocks). Real blocks are a prefix: loop over those only.
    n_real = jnp.sum(meta[1] < meta[2])
    outs = lax.fori_loop(0, (n_real + batch - 1) // batch, body, jnp.zeros((num_blocks, bq, hq, d), q.dtype))
    tok = meta[1][:, None] + rows[None, :]
    dest = jnp.where(tok < meta[2][:, None], tok, t)  # empty rows -> out of range, dropped
    return outs.reshape(-1, hq, d), dest.reshape(-1)


# (q, k_pages, v_pages, page_table, meta, num_blocks, *, scale, sliding_window, soft_cap, sinks,
#  k_scales, v_scales) -> (out f[NB', Hq, D], dest i32[NB']): the short requests' pass.
TokensPass = Callable[..., tuple[jax.Array, jax.Array]]
# the same plus keywords bq, max_gather_elems -> (out f[NB' * bq, Hq, D], dest): the block pass
BlocksPass = Callable[..., tuple[jax.Array, jax.Array]]


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    max_gather_elems: int = 1 << 18,
    tokens_pass: TokensPass | None = None,
    blocks_pass: BlocksPass | None = None,
) -> jax.Array:
    """Pure-jnp twin of `paged_attention` (same arguments and result; `interpret` is ignored).

    The two passes of the module docstring; `block_q` = the block pass alone with that block
    size for every request (tests). Full attention in the block pass gathers the `page_table`
    columns only: callers pass a table cut to the step's kv bucket (`page_table[:, :cols]`,
    cols covering the longest row). A sliding window gathers only the pages that can hold a
    block's window (`ceil((W + bq - 2) / page_size) + 1`; a token: those of its window), so
    pages wholly before it, holes included, are never read. A block-pass iteration gathers at
    most ~`max_gather_elems` K elements (at least one block): 2^18 (1 MiB of f32) beat 2^20
    and 2^22 by 1.3-4x, the gathered K/V stays in cache.
    `tokens_pass` / `blocks_pass` replace the two passes (`paged_attention_cpu` passes its
    native ones); the block metadata and the assembly stay these.
    Returns f[T, Hq, D] in q's dtype; padding tokens are zeros.
    """
    del interpret
    scale = check_inputs(
        q,
        k_pages,
        v_pages,
        page_table,
        kv_lens,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        k_scales=k_scales,
        v_scales=v_scales,
        bits_pools=True,
    )
    t, hq, d = q.shape
    s = page_table.shape[0]
    page_size = k_pages.shape[1]
    if t == 0:
        return jnp.zeros_like(q)
    common: dict[str, Any] = dict(
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    meta_args = (q, page_table, kv_lens, cu_q_lens, num_seqs, page_size)
    outs, dests = [], []
    if block_q is None:
        small = (1, PER_TOKEN_MAX_Q)
        meta, _ = block_metadata(*meta_args, 1, small)
        o, dst = (tokens_pass or _tokens_pass)(
            q, k_pages, v_pages, page_table, meta, min(t, PER_TOKEN_MAX_Q * s), **common
        )
        outs.append(o)
        dests.append(dst)
    if block_q is not None or t > PER_TOKEN_MAX_Q:
        bq = block_q or REFERENCE_BLOCK_Q
        big = None if block_q else (PER_TOKEN_MAX_Q + 1, t)
        meta, bound = block_metadata(*meta_args, bq, big)
        # real blocks come first; a request of >= 5 tokens has at most q_len / 5 blocks
        bound = min(bound, t if block_q else t // (PER_TOKEN_MAX_Q + 1))
        o, dst = (blocks_pass or _blocks_pass)(
            q, k_pages, v_pages, page_table, meta, bound, bq=bq, max_gather_elems=max_gather_elems, **common
        )
        outs.append(o)
        dests.append(dst)
    out = jnp.zeros_like(q)
    return out.at[jnp.concatenate(dests)].set(jnp.concatenate(outs), mode="drop")
