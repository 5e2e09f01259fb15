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
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend, kv_quant, pool_bits
from pallas_kernels.backend import Ref
from pallas_kernels.paged_attention_tuning import (
    DECODE_TUNING_CANDIDATES,
    PagedAttentionConfig,
    default_config,
)
from pallas_kernels.ragged import check_ragged_metadata, sanitize

__all__ = ["DECODE_TUNING_CANDIDATES", "PagedAttentionConfig", "default_config",
           "paged_attention", "paged_attention_reference", "reference_block_q"]

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


def _check_inputs(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                  kv_lens: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                  sm_scale: float | None, sliding_window: int | None, soft_cap: float | None,
                  sinks: jax.Array | None, k_scales: jax.Array | None = None,
                  v_scales: jax.Array | None = None, bits_pools: bool = False) -> float:
    """Static (shape/dtype/option) validation shared by kernel and reference; returns sm_scale.
    bits_pools (the reference): bf16 pools may also come as their uint16 bits, fp8 pools and
    f16 scales as uint8 / uint16 bits (`pool_bits`)."""
    floats = (jnp.float32, jnp.bfloat16)
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be [T, Hq, D]")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"{k_pages.shape=} and {v_pages.shape=} must both be "
                         "[P, page_size, Hkv, D]")
    t, hq, d = q.shape
    _, _, hkv, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"{q.shape=} and {k_pages.shape=} disagree on head_dim")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{q.shape=}: Hq must be a multiple of Hkv ({k_pages.shape=})")
    if (k_scales is None) != (v_scales is None):
        raise ValueError(f"{k_scales is None=} but {v_scales is None=}: a quantized cache "
                         "passes both scale pools")
    if k_scales is not None and v_scales is not None:
        _check_quantized(q, k_pages, v_pages, k_scales, v_scales, bits_pools)
    else:
        same = ((lambda a: pool_bits.holds(a, q.dtype)) if bits_pools
                else (lambda a: jnp.dtype(a) == q.dtype))
        if q.dtype not in floats or not same(k_pages.dtype) or not same(v_pages.dtype):
            raise ValueError(f"{q.dtype=}, {k_pages.dtype=}, {v_pages.dtype=} must all be "
                             "float32 or all bfloat16" + (" (pools: or uint16 bits)"
                                                          if bits_pools else ""))
    check_ragged_metadata(page_table, kv_lens, cu_q_lens, num_seqs)
    if sinks is not None and (sinks.shape != (hq,) or not jnp.issubdtype(sinks.dtype,
                                                                          jnp.floating)):
        raise ValueError(f"{sinks.shape=} must be float ({hq},) for {q.shape=}")
    if sliding_window is not None and (not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"{sliding_window=} must be None or an int >= 1")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{soft_cap=} must be None or > 0")
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"{sm_scale=} must be None or > 0")
    return float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)


def _check_quantized(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, k_scales: jax.Array,
                     v_scales: jax.Array, bits_pools: bool) -> None:
    """int8 / fp8 pools with f16 scales [P, page_size, Hkv] (`kv_quant`)."""
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{q.dtype=} must be float32 or bfloat16")
    vals = kv_quant.value_dtype(k_pages.dtype)
    if (vals is None or k_pages.dtype != v_pages.dtype
            or (not bits_pools and k_pages.dtype == pool_bits.BITS8)):
        raise ValueError(f"{k_pages.dtype=} and {v_pages.dtype=} must both be int8 or "
                         "float8_e4m3fn with scales" + (" (or its uint8 bits)" if bits_pools
                                                        else ""))
    for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
        if sc.shape != k_pages.shape[:3]:
            raise ValueError(f"{name}.shape={sc.shape} must be {k_pages.shape[:3]} "
                             f"([P, page_size, Hkv] of {k_pages.shape=})")
        ok = (pool_bits.holds(sc.dtype, kv_quant.SCALE_DTYPE) if bits_pools
              else jnp.dtype(sc.dtype) == kv_quant.SCALE_DTYPE)
        if not ok:
            raise ValueError(f"{name}.dtype={sc.dtype} must be float16")


def _block_metadata(q: jax.Array, page_table: jax.Array, kv_lens: jax.Array,
                    cu_q_lens: jax.Array, num_seqs: jax.Array, page_size: int,
                    block_q: int) -> tuple[jax.Array, int]:
    """i32[4, NB]: per grid block (request, first token, end token, position offset).

    NB = cdiv(T, block_q) + S bounds sum_s cdiv(q_len_s, block_q). Surplus blocks (past the last
    real one) get the empty token range [T, T) of request 0 with offset 0: the kernel derives an
    empty key range from it and does no work (no page-table or K/V access at all).
    """
    t, s = q.shape[0], page_table.shape[0]
    cu, kv, q_len = sanitize(cu_q_lens, kv_lens, num_seqs, t, page_table.shape[1] * page_size)
    nb_per_seq = (q_len + block_q - 1) // block_q
    ends = jnp.cumsum(nb_per_seq)
    num_blocks = pl.cdiv(t, block_q) + s
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    # compare_all: S is small (<= a few hundred), and a [NB, S] compare + sum is one fused op on
    # GPU where the default binary search is a sequential loop of gathers.
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right", method="compare_all"),
                      s - 1).astype(jnp.int32)
    real = b < ends[-1]
    within = b - (ends[seq] - nb_per_seq[seq])
    q0 = cu[seq] + within * block_q
    q1 = jnp.minimum(q0 + block_q, cu[seq + 1])
    pos_off = kv[seq] - cu[seq + 1]  # absolute position = packed token index + pos_off
    meta = [jnp.where(real, seq, 0), jnp.where(real, q0, t), jnp.where(real, q1, t),
            jnp.where(real, pos_off, 0)]
    return jnp.stack(meta).astype(jnp.int32), num_blocks


def _kernel(meta_ref: Ref, pt_ref: Ref, q_ref: Ref, k_ref: Ref, v_ref: Ref, sinks_ref: Ref,
            *refs: Ref, group: int, block_q: int,
            pages_per_block: int, page_size: int, head_dim: int, num_tokens: int,
            pool_tokens: int, scale: float, window: int | None, soft_cap: float | None,
            has_sinks: bool, kv_splits: int, quantized: bool) -> None:
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
    q = backend.load(q_ref, (tok_idx[:, None], head[:, None], d[None, :]),
                     mask=row_ok[:, None], other=0.0)

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
        sink = backend.load(sinks_ref, (jnp.where(g < group, head, 0),), mask=g < group,
                            other=0.0)
        m0, l0 = sink.astype(jnp.float32) * _LOG2E, jnp.ones((n_rows,), jnp.float32)
    else:
        m0, l0 = jnp.full((n_rows,), _MASK, jnp.float32), jnp.zeros((n_rows,), jnp.float32)
    if kv_splits == 1:
        acc, _, denom, _ = lax.fori_loop(0, n_iter, body, (acc, m0, l0, page_ids(0)))
        out = acc / jnp.where(denom > 0.0, denom, 1.0)[:, None]
        backend.store(out_refs[0], (tok_idx[:, None], head[:, None], d[None, :]),
                      out.astype(out_refs[0].dtype), mask=row_ok[:, None])
        return
    split = pl.program_id(2)
    chunk = (n_iter + kv_splits - 1) // kv_splits
    start = split * chunk
    acc, m, denom, _ = lax.fori_loop(start, jnp.minimum(start + chunk, n_iter), body,
                                     (acc, m0, l0, page_ids(start)))
    acc_ref, m_ref, l_ref = out_refs
    backend.store(acc_ref, (split, tok_idx[:, None], head[:, None], d[None, :]), acc,
                  mask=row_ok[:, None])
    backend.store(m_ref, (split, tok_idx, head), m, mask=row_ok)
    backend.store(l_ref, (split, tok_idx, head), denom, mask=row_ok)


def _merge_splits(acc: jax.Array, m: jax.Array, denom: jax.Array, sinks: jax.Array | None,
                  dtype: jnp.dtype) -> jax.Array:
    """Combine per-split partials f32[K, T, Hq, (D)] (max in the log2 domain) into f[T, Hq, D].
    Rows no program wrote keep acc=0, m=_MASK, denom=0 and come out as zeros."""
    m_tot = jnp.max(m, axis=0)
    if sinks is not None:
        sink2 = sinks.astype(jnp.float32) * _LOG2E
        m_tot = jnp.maximum(m_tot, sink2[None, :])
    w = jnp.exp2(m - m_tot[None])
    num = jnp.sum(w[..., None] * acc, axis=0)
    den = jnp.sum(w * denom, axis=0)
    if sinks is not None:
        den = den + jnp.exp2(sink2[None, :] - m_tot)
    return (num / jnp.where(den > 0.0, den, 1.0)[..., None]).astype(dtype)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    page_table: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array,
                    num_seqs: jax.Array, *, sm_scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    sinks: jax.Array | None = None, k_scales: jax.Array | None = None,
                    v_scales: jax.Array | None = None, interpret: bool = False,
                    config: PagedAttentionConfig | None = None) -> jax.Array:
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
      config: tuning; None = `default_config(...)` for these static shapes.

    Returns:
      f[T, Hq, D] in q's dtype; padding tokens are zeros.
    """
    scale = _check_inputs(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs,
                          sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                          sinks=sinks, k_scales=k_scales, v_scales=v_scales)
    quantized = k_scales is not None and v_scales is not None
    t, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    group = hq // hkv
    _check_kernel_shapes(page_size, d)
    cfg = config or default_config(t, page_table.shape[0], page_size, group, hkv,
                                   page_table.shape[1])
    _check_config(cfg, page_size, group)
    if t == 0:
        return jnp.zeros_like(q)
    meta, num_blocks = _block_metadata(q, page_table, kv_lens, cu_q_lens, num_seqs, page_size,
                                       cfg.block_q)
    kernel = functools.partial(
        _kernel, group=group, block_q=cfg.block_q, pages_per_block=cfg.pages_per_block,
        page_size=page_size, head_dim=d, num_tokens=t, pool_tokens=num_pages * page_size,
        scale=scale, window=sliding_window, soft_cap=soft_cap, has_sinks=sinks is not None,
        kv_splits=cfg.kv_splits, quantized=quantized)
    sinks_arr = (sinks.astype(jnp.float32) if sinks is not None
                 else jnp.zeros((hq,), jnp.float32))
    # Outputs start from aliased buffers: rows no program writes (padding) stay at these values.
    if cfg.kv_splits == 1:
        inits = [jnp.zeros_like(q)]
        grid: tuple[int, ...] = (num_blocks, hkv)
    else:
        k = cfg.kv_splits
        inits = [jnp.zeros((k, t, hq, d), jnp.float32), jnp.full((k, t, hq), _MASK, jnp.float32),
                 jnp.zeros((k, t, hq), jnp.float32)]
        grid = (num_blocks, hkv, k)
    call = backend.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inits], grid=grid,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
        name=f"ragged_paged_attention_bq{cfg.block_q}_ppb{cfg.pages_per_block}"
             f"_split{cfg.kv_splits}" + (f"_{k_pages.dtype}" if quantized else ""),
        input_output_aliases={6 + 2 * quantized + i: i for i in range(len(inits))})
    # Flattened pools: token-granular row index page * page_size + offset (free reshape).
    flat_shape = (num_pages * page_size, hkv, d)
    scales = ([k_scales.reshape(flat_shape[:2]), v_scales.reshape(flat_shape[:2])]
              if k_scales is not None and v_scales is not None else [])
    outs = call(meta, page_table.astype(jnp.int32), q, k_pages.reshape(flat_shape),
                v_pages.reshape(flat_shape), sinks_arr, *scales, *inits)
    if cfg.kv_splits == 1:
        out: jax.Array = outs[0]
        return out
    acc, m, denom = outs
    return _merge_splits(acc, m, denom, sinks, q.dtype)


def _gather(pool: jax.Array, scales: jax.Array | None, pages: jax.Array, dtype: jnp.dtype
            ) -> jax.Array:
    """f32 K or V rows of `pages` (float pool, or quantized values times their scales)."""
    vals = kv_quant.value_dtype(pool.dtype)
    if scales is None or vals is None:
        return pool_bits.take(pool, pages, dtype).astype(jnp.float32)
    return kv_quant.dequantize(pool_bits.take(pool, pages, vals),
                               pool_bits.take(scales, pages, kv_quant.SCALE_DTYPE))


def reference_block_q(num_tokens: int, num_seqs_max: int) -> int:
    """Query tokens per block of `paged_attention_reference`: 1 for decode-shaped steps (every
    token is its own request: a block per token gathers nothing twice), 16 otherwise (a prefill
    chunk gathers its request's K/V once per 16 tokens instead of once per token)."""
    return 1 if num_tokens <= 2 * num_seqs_max else 16


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              page_table: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array,
                              num_seqs: jax.Array, *, sm_scale: float | None = None,
                              sliding_window: int | None = None, soft_cap: float | None = None,
                              sinks: jax.Array | None = None,
                              k_scales: jax.Array | None = None,
                              v_scales: jax.Array | None = None, interpret: bool = False,
                              block_q: int | None = None,
                              max_gather_elems: int = 1 << 22) -> jax.Array:
    """Pure-jnp twin of `paged_attention` (same arguments and result; `interpret` is ignored).

    Also the runtime's CPU backend, so its cost follows the real context:
    - work is split into blocks of up to `block_q` query tokens of ONE request (None =
      `reference_block_q`); a block gathers its request's K/V once, float32 math;
    - full attention gathers the `page_table` columns only: callers pass a table cut to the
      step's kv bucket (`page_table[:, :cols]`, cols covering the longest row) and the gather
      shrinks with it;
    - a sliding window gathers only the `ceil((W + block_q - 2) / page_size) + 1` pages that can
      hold the block's window (pages wholly before it, holes included, are never read).
    Everything outside `[max(0, pos - W + 1), pos]` is masked with `jnp.where` (logits AND
    values, since NaN * 0 = NaN); fully masked rows (padding) come out as zeros, never NaN.
    Blocks run `lax.map` batches of at most ~`max_gather_elems` gathered K elements.
    Returns f[T, Hq, D] in q's dtype; padding tokens are zeros.
    """
    del interpret
    scale = _check_inputs(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs,
                          sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                          sinks=sinks, k_scales=k_scales, v_scales=v_scales, bits_pools=True)
    t, hq, d = q.shape
    _, page_size, hkv, _ = k_pages.shape
    s, max_pages = page_table.shape
    group = hq // hkv
    if t == 0:
        return jnp.zeros_like(q)
    bq = block_q or reference_block_q(t, s)
    if sliding_window is None:
        n_cols = max_pages
    else:
        n_cols = min(max_pages, (sliding_window + bq - 2 + page_size - 1) // page_size + 1)
    span = n_cols * page_size
    meta, num_blocks = _block_metadata(q, page_table, kv_lens, cu_q_lens, num_seqs, page_size, bq)
    num_blocks = min(num_blocks, t)  # a non-empty block holds >= 1 token: at most T of them
    meta = meta[:, :num_blocks]
    sink_logits = (None if sinks is None
                   else sinks.astype(jnp.float32).reshape(1, hkv, group, 1))
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
        keep = (ok[:, None] & (kpos[None, :] <= qpos[:, None])
                & (kpos < max_pages * page_size)[None, :])
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
            logits = jnp.concatenate(
                [logits, jnp.broadcast_to(sink_logits, (bq, hkv, group, 1))], axis=-1)
        mx = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.exp(logits - jnp.where(jnp.isfinite(mx), mx, 0.0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("qhgl,lhd->qhgd", p[..., :span], v, precision=lax.Precision.HIGHEST)
        o = o / jnp.where(denom > 0, denom, 1.0)
        return jnp.where(ok[:, None, None], o.reshape(bq, hq, d), 0.0).astype(q.dtype)

    batch = max(1, min(num_blocks, max_gather_elems // max(1, span * hkv * d)))
    if batch == num_blocks:  # one batch: a plain vmap, no loop
        outs = jax.vmap(one)(meta.T)
    else:  # whole batches only (lax.map would compile a remainder batch as a second copy)
        pad = -num_blocks % batch  # empty blocks: q0 == q1 == 0, every row masked
        meta = jnp.pad(meta, ((0, 0), (0, pad)))
        outs = lax.map(one, meta.T, batch_size=batch)  # [NB, bq, Hq, D]
    tok = meta[1][:, None] + rows[None, :]
    dest = jnp.where(tok < meta[2][:, None], tok, t)  # empty rows -> out of range, dropped
    out = jnp.zeros_like(q)
    return out.at[dest.reshape(-1)].set(outs.reshape(-1, hq, d), mode="drop")
