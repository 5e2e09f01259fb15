"""Input validation and ragged block metadata shared by the Pallas paged-attention kernel
(`paged_attention`) and its jnp twin (`paged_attention_reference`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import kv_quant, pool_bits
from pallas_kernels.ragged import check_ragged_metadata, sanitize

__all__ = ["block_metadata", "check_inputs", "check_quantized"]


def check_inputs(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: jax.Array | None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    bits_pools: bool = False,
) -> float:
    """Static (shape/dtype/option) validation shared by kernel and reference; returns sm_scale.
    bits_pools (the reference): bf16 pools may also come as their uint16 bits, fp8 pools and
    f16 scales as uint8 / uint16 bits (`pool_bits`)."""
    floats = (jnp.float32, jnp.bfloat16)
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be [T, Hq, D]")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"{k_pages.shape=} and {v_pages.shape=} must both be [P, page_size, Hkv, D]")
    t, hq, d = q.shape
    _, _, hkv, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"{q.shape=} and {k_pages.shape=} disagree on head_dim")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{q.shape=}: Hq must be a multiple of Hkv ({k_pages.shape=})")
    if (k_scales is None) != (v_scales is None):
        raise ValueError(
            f"{k_scales is None=} but {v_scales is None=}: a quantized cache passes both scale pools"
        )
    if k_scales is not None and v_scales is not None:
        check_quantized(q, k_pages, v_pages, k_scales, v_scales, bits_pools)
    else:
        same = (lambda a: pool_bits.holds(a, q.dtype)) if bits_pools else (lambda a: jnp.dtype(a) == q.dtype)
        if q.dtype not in floats or not same(k_pages.dtype) or not same(v_pages.dtype):
            raise ValueError(
                f"{q.dtype=}, {k_pages.dtype=}, {v_pages.dtype=} must all be "
                "float32 or all bfloat16" + (" (pools: or uint16 bits)" if bits_pools else "")
            )
    check_ragged_metadata(page_table, kv_lens, cu_q_lens, num_seqs)
    if sinks is not None and (sinks.shape != (hq,) or not jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise ValueError(f"{sinks.shape=} must be float ({hq},) for {q.shape=}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{sliding_window=} must be None or an int >= 1")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{soft_cap=} must be None or > 0")
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"{sm_scale=} must be None or > 0")
    return float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)


def check_quantized(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scales: jax.Array,
    v_scales: jax.Array,
    bits_pools: bool,
) -> None:
    """int8 / fp8 pools with f16 scales [P, page_size, Hkv] (`kv_quant`)."""
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{q.dtype=} must be float32 or bfloat16")
    vals = kv_quant.value_dtype(k_pages.dtype)
    if (
        vals is None
        or k_pages.dtype != v_pages.dtype
        or (not bits_pools and k_pages.dtype == pool_bits.BITS8)
    ):
        raise ValueError(
            f"{k_pages.dtype=} and {v_pages.dtype=} must both be int8 or "
            "float8_e4m3fn with scales" + (" (or its uint8 bits)" if bits_pools else "")
        )
    for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
        if sc.shape != k_pages.shape[:3]:
            raise ValueError(
                f"{name}.shape={sc.shape} must be {k_pages.shape[:3]} "
                f"([P, page_size, Hkv] of {k_pages.shape=})"
            )
        ok = (
            pool_bits.holds(sc.dtype, kv_quant.SCALE_DTYPE)
            if bits_pools
            else jnp.dtype(sc.dtype) == kv_quant.SCALE_DTYPE
        )
        if not ok:
            raise ValueError(f"{name}.dtype={sc.dtype} must be float16")


def block_metadata(
    q: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    page_size: int,
    block_q: int,
    q_len_range: tuple[int, int] | None = None,
    max_blocks: int | None = None,
) -> tuple[jax.Array, int]:
    """i32[4, NB]: per grid block (request, first token, end token, position offset).

    NB = cdiv(T, block_q) + S bounds sum_s cdiv(q_len_s, block_q). Real blocks come first;
    surplus blocks get the empty token range [T, T) of request 0 with offset 0: the kernel
    derives an empty key range from it and does no work (no page-table or K/V access at all).
    `q_len_range=(lo, hi)` keeps only requests with lo <= q_len <= hi (the others get no block);
    `max_blocks` then may bound NB tighter (S when hi <= block_q: one block per request).
    """
    t, s = q.shape[0], page_table.shape[0]
    cu, kv, q_len = sanitize(cu_q_lens, kv_lens, num_seqs, t, page_table.shape[1] * page_size)
    nb_per_seq = (q_len + block_q - 1) // block_q
    if q_len_range is not None:
        nb_per_seq = jnp.where((q_len >= q_len_range[0]) & (q_len <= q_len_range[1]), nb_per_seq, 0)
    ends = jnp.cumsum(nb_per_seq)
    num_blocks = pl.cdiv(t, block_q) + s if max_blocks is None else max_blocks
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    # compare_all: S is small (<= a few hundred), and a [NB, S] compare + sum is one fused op on
    # GPU where the default binary search is a sequential loop of gathers.
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right", method="compare_all"), s - 1).astype(jnp.int32)
    real = b < ends[-1]
    within = b - (ends[seq] - nb_per_seq[seq])
    q0 = cu[seq] + within * block_q
    q1 = jnp.minimum(q0 + block_q, cu[seq + 1])
    pos_off = kv[seq] - cu[seq + 1]  # absolute position = packed token index + pos_off
    meta = [
        jnp.where(real, seq, 0),
        jnp.where(real, q0, t),
        jnp.where(real, q1, t),
        jnp.where(real, pos_off, 0),
    ]
    return jnp.stack(meta).astype(jnp.int32), num_blocks
