"""Ragged paged attention (prefill chunks and decodes in one call) as a Pallas GPU kernel.

Layout: `q f[T, Hq, D]` packs every request's query tokens; K/V live in page pools
`f[P, page_size, Hkv, D]`; request `s` reads its pages through `page_table[s]` (0 = null page).

Kernel design (Triton lowering, see `backend.py`):
- The grid is `(query blocks, kv heads)`. A query block is up to `block_q` consecutive query tokens
  of ONE request; its rows are `block_q x next_pow2(G)` (token, q head of the GQA group) pairs, so a
  decode step loads each K/V tile once for all G query heads that share it. Block -> request
  metadata is computed with a handful of `[S]`-sized jnp ops outside the kernel; surplus grid
  programs (the grid size is a static upper bound) do zero loop iterations.
- Each program loops over blocks of `pages_per_block` pages from the page holding the block's
  first in-window key to the page holding its last query. Pages wholly before the sliding window
  are never visited, so a hole (page 0) there is never loaded, and a 32k context with a 4k window
  streams only 4k tokens. Online softmax in float32 (exp2 domain); loads are masked, and logits
  and probabilities go through `jnp.where`, so NaN garbage outside `[window start, query]` never
  reaches the output.
- Sinks enter as the initial running max/denominator (a key with logit `sink` and value 0).
- Output rows are written with masked stores into a zero-initialised aliased buffer, so padding
  tokens come out as exact zeros.
- A prefill-shaped batch of several requests runs as two launches into that one buffer
  (`MixedConfig`): the short requests (decodes, speculative rows) at the 16-row decode config,
  then the prefill chunks at 64 rows, each launch's block metadata keeping only its requests.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend
from pallas_kernels.backend import Ref
from pallas_kernels.paged_attention_inputs import block_metadata, check_inputs
from pallas_kernels.paged_attention_jnp import paged_attention_reference
from pallas_kernels.paged_attention_tuning import (
    DECODE_TUNING_CANDIDATES,
    MixedConfig,
    PagedAttentionConfig,
    default_config,
    mixed_config,
)

__all__ = [
    "DECODE_TUNING_CANDIDATES",
    "MixedConfig",
    "PagedAttentionConfig",
    "default_config",
    "mixed_config",
    "paged_attention",
    "paged_attention_reference",
]

_LOG2E = math.log2(math.e)
_MASK = -1e30  # finite: (mask - mask) must stay 0, never inf - inf = NaN


def _check_kernel_shapes(page_size: int, head_dim: int) -> None:
    """Triton tiles must be powers of two (the jnp reference has no such limit)."""
    if not backend.is_power_of_2(page_size):
        raise ValueError(f"page_size={page_size} must be a power of two for the Pallas kernel")
    if not backend.is_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the Pallas kernel")


def _check_config(cfg: PagedAttentionConfig, page_size: int, group: int) -> None:
    if cfg.pages_per_block * page_size < 16:
        raise ValueError(f"{cfg.pages_per_block=} * {page_size=} must be >= 16 tokens")
    if cfg.block_q * backend.next_power_of_2(group) < 16:
        raise ValueError(f"{cfg.block_q=} * next_pow2({group=}) must be >= 16 rows")


def _kernel(
    meta_ref: Ref,
    pt_ref: Ref,
    q_ref: Ref,
    k_ref: Ref,
    v_ref: Ref,
    sinks_ref: Ref,
    *refs: Ref,
    group: int,
    block_q: int,
    pages_per_block: int,
    page_size: int,
    head_dim: int,
    num_tokens: int,
    pool_tokens: int,
    scale: float,
    window: int | None,
    soft_cap: float | None,
    has_sinks: bool,
    kv_splits: int,
    quantized: bool,
) -> None:
    # refs: (quantized) the K and V scale pools, then aliased initial buffers, then outputs:
    # (out,) or (acc, max, denominator) partials.
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    # `other` of the K/V loads in the pools' kind: Triton casts an int to int8, a float to fp8
    zero = 0 if jnp.issubdtype(k_ref.dtype, jnp.integer) else 0.0
    refs = refs[2:] if quantized else refs
    out_refs = refs[len(refs) // 2 :]
    b, h = pl.program_id(0), pl.program_id(1)
    seq, q0, q1, pos_off = meta_ref[0, b], meta_ref[1, b], meta_ref[2, b], meta_ref[3, b]
    gp = backend.next_power_of_2(group)
    rows = lax.iota(jnp.int32, block_q * gp)
    tok = q0 + rows // gp
    g = rows % gp
    row_ok = (tok < q1) & (g < group)
    # Out-of-range sentinel for masked rows: dropped by interpret-mode scatters, never touched
    # on GPU, and never aliasing a real row of this store.
    tok_idx = jnp.where(row_ok, tok, num_tokens)
    head = h * group + g
    qpos = tok + pos_off
    d = lax.iota(jnp.int32, head_dim)
    q = backend.load(q_ref, (tok_idx[:, None], head[:, None], d[None, :]), mask=row_ok[:, None], other=0.0)

    # Key range of the whole block: union over its rows of [qpos - W + 1, qpos]; empty for a
    # surplus block (q0 == q1), which therefore never touches the page table or the pools.
    lo = jnp.maximum(q0 + pos_off - window + 1, 0) if window is not None else jnp.int32(0)
    hi = jnp.where(q1 > q0, q1 + pos_off, lo)  # exclusive; <= kv_len <= max_pages * page_size
    page_lo = lo // page_size
    page_hi = jnp.where(hi > lo, (hi + page_size - 1) // page_size, page_lo)
    n_iter = (page_hi - page_lo + pages_per_block - 1) // pages_per_block

    block_k = pages_per_block * page_size
    kk = lax.iota(jnp.int32, block_k)
    in_page = kk % page_size
    qk_scale = scale if soft_cap is None else scale / soft_cap

    def page_ids(j: jax.Array | int) -> jax.Array:
        """The tile's page ids: one load per PAGE (not per token), masked past the key range."""
        slot = page_lo + j * pages_per_block + lax.iota(jnp.int32, pages_per_block)
        ok = slot < page_hi
        return backend.load(pt_ref, (seq, slot), mask=ok, other=0)

    Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array]

    def body(j: jax.Array, carry: Carry) -> Carry:
        # The tile's page ids come in through the carry, loaded one iteration earlier, so the K/V
        # loads of tile j+1 depend on nothing computed in iteration j+1: Triton's software
        # pipeliner can then issue them `num_stages - 1` tiles ahead (cp.async multi-buffering).
        acc, m, denom, pages = carry
        next_pages = page_ids(j + 1)
        kpos = (page_lo + j * pages_per_block) * page_size + kk
        k_ok = (kpos >= lo) & (kpos < hi)
        if pages_per_block == 1:
            page = jnp.broadcast_to(pages, (block_k,))
        else:  # expand [ppb] page ids to [ppb * page_size] tokens
            page = jnp.broadcast_to(pages[:, None], (pages_per_block, page_size)).reshape(block_k)
        flat = jnp.where(k_ok, page * page_size + in_page, pool_tokens)
        kv_idx = (flat[:, None], h, d[None, :])
        k = backend.load(k_ref, kv_idx, mask=k_ok[:, None], other=zero)
        if quantized:  # int8 / fp8 values are exact in q's dtype; the row scales go on after
            k = k.astype(q.dtype)
            k_scale = backend.load(ks_ref, (flat, h), mask=k_ok, other=0).astype(jnp.float32)
            logits = backend.dot(q, k, trans_b=True) * (k_scale[None, :] * qk_scale)
        else:
            logits = backend.dot(q, k, trans_b=True) * qk_scale
        if soft_cap is not None:
            logits = jnp.tanh(logits) * soft_cap
        logits = logits * _LOG2E
        mask = row_ok[:, None] & k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if window is not None:
            mask = mask & (kpos[None, :] > qpos[:, None] - window)
        logits = jnp.where(mask, logits, _MASK)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(mask, jnp.exp2(logits - m_new[:, None]), 0.0)
        v = backend.load(v_ref, kv_idx, mask=k_ok[:, None], other=zero)
        pv = p
        if quantized:  # p @ (v * s) = (p * s) @ v: the V row scales weight p's columns
            v = v.astype(q.dtype)
            pv = p * backend.load(vs_ref, (flat, h), mask=k_ok, other=0).astype(jnp.float32)[None, :]
        acc = acc * alpha[:, None] + backend.dot(pv.astype(v.dtype), v)
        return acc, m_new, denom * alpha + jnp.sum(p, axis=1), next_pages

    n_rows = block_q * gp
    acc = jnp.zeros((n_rows, head_dim), jnp.float32)
    if has_sinks and kv_splits == 1:  # with splits, the sink is merged once, outside
        sink = backend.load(sinks_ref, (jnp.where(g < group, head, 0),), mask=g < group, other=0.0)
        m0, l0 = sink.astype(jnp.float32) * _LOG2E, jnp.ones((n_rows,), jnp.float32)
    else:
        m0, l0 = jnp.full((n_rows,), _MASK, jnp.float32), jnp.zeros((n_rows,), jnp.float32)
    if kv_splits == 1:
        acc, _, denom, _ = lax.fori_loop(0, n_iter, body, (acc, m0, l0, page_ids(0)))
        out = acc / jnp.where(denom > 0.0, denom, 1.0)[:, None]
        backend.store(
            out_refs[0],
            (tok_idx[:, None], head[:, None], d[None, :]),
            out.astype(out_refs[0].dtype),
            mask=row_ok[:, None],
        )
        return
    split = pl.program_id(2)
    chunk = (n_iter + kv_splits - 1) // kv_splits
    start = split * chunk
    acc, m, denom, _ = lax.fori_loop(
        start, jnp.minimum(start + chunk, n_iter), body, (acc, m0, l0, page_ids(start))
    )
    acc_ref, m_ref, l_ref = out_refs
    backend.store(acc_ref, (split, tok_idx[:, None], head[:, None], d[None, :]), acc, mask=row_ok[:, None])
    backend.store(m_ref, (split, tok_idx, head), m, mask=row_ok)
    backend.store(l_ref, (split, tok_idx, head), denom, mask=row_ok)


def _merge_splits(
    acc: jax.Array, m: jax.Array, denom: jax.Array, sinks: jax.Array | None, unwritten: jax.Array
) -> jax.Array:
    """Combine per-split partials f32[K, T, Hq, (D)] (max in the log2 domain) into f[T, Hq, D].
    Rows no program wrote (padding, requests of another launch) keep m=_MASK in every split and
    come out as `unwritten` f[T, Hq, D]; a written row's max is a real logit (it sees its own
    key), far above _MASK."""
    m_max = jnp.max(m, axis=0)
    written = m_max > 0.5 * _MASK
    m_tot = m_max
    if sinks is not None:
        sink2 = sinks.astype(jnp.float32) * _LOG2E
        m_tot = jnp.maximum(m_tot, sink2[None, :])
    w = jnp.exp2(m - m_tot[None])
    num = jnp.sum(w[..., None] * acc, axis=0)
    den = jnp.sum(w * denom, axis=0)
    if sinks is not None:
        den = den + jnp.exp2(sink2[None, :] - m_tot)
    merged = num / jnp.where(den > 0.0, den, 1.0)[..., None]
    return jnp.where(written[..., None], merged.astype(unwritten.dtype), unwritten)


def paged_attention(
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
    config: PagedAttentionConfig | MixedConfig | None = None,
) -> jax.Array:
    """Ragged paged attention (Pallas GPU kernel; `interpret=True` runs it on CPU).

    Args:
      q: f[T, Hq, D] packed query tokens of all requests (float32 or bfloat16).
      k_pages, v_pages: f[P, page_size, Hkv, D] page pools (same dtype as q); Hq % Hkv == 0.
      page_table: i32[S, max_pages] page ids per request slot (0 = null page / hole).
      kv_lens: i32[S] tokens in cache per request, including this step's query tokens.
      cu_q_lens: i32[S+1] prefix sums of query tokens per request.
      num_seqs: i32[1] live requests; rows >= num_seqs are padding.
      sm_scale: logit scale, default 1/sqrt(D).
      sliding_window: W >= 1: the query at position n sees keys [n-W+1, n]; None = full causal.
      soft_cap: if set, logits become `cap * tanh(logits / cap)` (after scaling).
      sinks: f[Hq] per-head sink logits (join the softmax denominator, contribute no value).
      k_scales, v_scales: f16[P, page_size, Hkv] for a quantized cache (`kv_quant`): the pools
        are then int8 / float8_e4m3fn and a cached value is `page value * scale`.
      interpret: run the kernel with the Pallas interpreter (CPU tests).
      config: tuning; None = `mixed_config(...)` (two launches: decodes, then prefill chunks)
        for prefill-shaped batches of several requests, else `default_config(...)`.

    Returns:
      f[T, Hq, D] in q's dtype; padding tokens are zeros.
    """
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
    )
    t, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    group = hq // hkv
    _check_kernel_shapes(page_size, d)
    s, max_pages = page_table.shape
    if config is None:
        config = mixed_config(t, s, page_size, group, hkv, max_pages) or default_config(
            t, s, page_size, group, hkv, max_pages
        )
    parts = (
        [
            (config.decode, (1, config.decode.block_q), s),
            (config.prefill, (config.decode.block_q + 1, t), None),
        ]
        if isinstance(config, MixedConfig)
        else [(config, None, None)]
    )
    for cfg, _, _ in parts:
        _check_config(cfg, page_size, group)
    if t == 0:
        return jnp.zeros_like(q)
    launch = functools.partial(
        _launch,
        q,
        k_pages,
        v_pages,
        page_table,
        kv_lens,
        cu_q_lens,
        num_seqs,
        scale=scale,
        window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        k_scales=k_scales,
        v_scales=v_scales,
        interpret=interpret,
    )
    out = jnp.zeros_like(q)
    for cfg, q_len_range, max_blocks in parts:
        out = launch(cfg, q_len_range, max_blocks, out)
    return out


def _launch(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    cfg: PagedAttentionConfig,
    q_len_range: tuple[int, int] | None,
    max_blocks: int | None,
    out: jax.Array,
    *,
    scale: float,
    window: int | None,
    soft_cap: float | None,
    sinks: jax.Array | None,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
    interpret: bool,
) -> jax.Array:
    """One kernel launch over the requests in `q_len_range` (None: all); returns `out` f[T, Hq,
    D] with their rows written and every other row as it came in."""
    quantized = k_scales is not None and v_scales is not None
    t, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    meta, num_blocks = block_metadata(
        q, page_table, kv_lens, cu_q_lens, num_seqs, page_size, cfg.block_q, q_len_range, max_blocks
    )
    kernel = functools.partial(
        _kernel,
        group=hq // hkv,
        block_q=cfg.block_q,
        pages_per_block=cfg.pages_per_block,
        page_size=page_size,
        head_dim=d,
        num_tokens=t,
        pool_tokens=num_pages * page_size,
        scale=scale,
        window=window,
        soft_cap=soft_cap,
        has_sinks=sinks is not None,
        kv_splits=cfg.kv_splits,
        quantized=quantized,
    )
    sinks_arr = sinks.astype(jnp.float32) if sinks is not None else jnp.zeros((hq,), jnp.float32)
    # Outputs start from aliased buffers: rows no program writes (padding, or requests of the
    # other launch) keep these values.
    if cfg.kv_splits == 1:
        inits = [out]
        grid: tuple[int, ...] = (num_blocks, hkv)
    else:
        k = cfg.kv_splits
        inits = [
            jnp.zeros((k, t, hq, d), jnp.float32),
            jnp.full((k, t, hq), _MASK, jnp.float32),
            jnp.zeros((k, t, hq), jnp.float32),
        ]
        grid = (num_blocks, hkv, k)
    call = backend.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inits],
        grid=grid,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
        name=f"ragged_paged_attention_bq{cfg.block_q}_ppb{cfg.pages_per_block}"
        f"_split{cfg.kv_splits}" + (f"_{k_pages.dtype}" if quantized else ""),
        input_output_aliases={6 + 2 * quantized + i: i for i in range(len(inits))},
    )
    # Flattened pools: token-granular row index page * page_size + offset (free reshape).
    flat_shape = (num_pages * page_size, hkv, d)
    scales = (
        [k_scales.reshape(flat_shape[:2]), v_scales.reshape(flat_shape[:2])]
        if k_scales is not None and v_scales is not None
        else []
    )
    outs = call(
        meta,
        page_table.astype(jnp.int32),
        q,
        k_pages.reshape(flat_shape),
        v_pages.reshape(flat_shape),
        sinks_arr,
        *scales,
        *inits,
    )
    if cfg.kv_splits == 1:
        written: jax.Array = outs[0]
        return written
    acc, m, denom = outs
    return _merge_splits(acc, m, denom, sinks, out)
