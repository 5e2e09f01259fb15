"""`paged_attention_cpu`: paged attention for XLA:CPU, both passes in native code.

Same arguments and result as `paged_attention` / `paged_attention_reference`, and the same
split of a step's requests: the short ones (<= `PER_TOKEN_MAX_Q` query tokens: decodes, short
drafts) in one-token blocks, the longer ones (prefill chunks) in blocks of `REFERENCE_BLOCK_Q`
tokens (the reference's block metadata). Each pass is one C++ custom call
(`pallas_kernels/native/paged_attention.cc`), split over XLA's intra-op threads:
- a one-token block reads each visible K row once and dots it with its query heads;
- a longer block reads each of its pages once as a transposed [D, page] K tile, computes the
  block's logits as rank-1 updates, an online softmax per query row, then P @ V.
When the native kernel cannot be built here (no C++ compiler), the whole call is the reference.

Pools of every kind the reference reads: float32, bf16 (as itself or as its uint16 bits,
`pool_bits`), int8 and fp8 e4m3 (as itself or its uint8 bits) with f16 scales.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant, native, pool_bits
from pallas_kernels.paged_attention_jnp import pad_meta, paged_attention_reference

__all__ = [
    "TARGET",
    "available",
    "kv_kind",
    "native_blocks_pass",
    "native_tokens_pass",
    "paged_attention_cpu",
]

TARGET = "tokenspeed_paged_attention"
# pool kinds of the C++ kernel (`KvKind` in paged_attention.cc)
_F32, _BF16, _INT8, _FP8 = 0, 1, 3, 4


def available() -> bool:
    """Whether the native kernel is built and registered in this process (builds it once)."""
    return native.load("paged_attention") is not None


def kv_kind(pool_dtype: Any, q_dtype: Any) -> int:
    """The C++ kernel's pool kind for pages of `pool_dtype` in a model computing in `q_dtype`
    (uint16 pools hold the model dtype's bits)."""
    dt = jnp.dtype(pool_dtype)
    quantized = kv_quant.value_dtype(dt)
    if quantized is not None:
        return _INT8 if quantized == jnp.dtype(jnp.int8) else _FP8
    if dt == jnp.dtype(jnp.float32):
        return _F32
    if dt == pool_bits.BITS and jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16):
        dt = jnp.dtype(q_dtype)
    if dt == jnp.dtype(jnp.bfloat16):
        return _BF16
    raise ValueError(f"{pool_dtype=} / {q_dtype=}: no native paged-attention kind for this pool")


def _call(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    meta: jax.Array,
    bq: int,
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: jax.Array | None,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
) -> jax.Array:
    """Blocks `meta` i32[4, NB] of up to `bq` tokens -> f32[NB, bq, Hq, D] (zeros past a block's
    end and for empty blocks)."""
    _, hq, d = q.shape
    dummy = jnp.zeros((1,), pool_bits.BITS)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((meta.shape[1], bq, hq, d), jnp.float32))
    out: jax.Array = call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        dummy if k_scales is None else k_scales,
        dummy if v_scales is None else v_scales,
        page_table.astype(jnp.int32),
        meta.astype(jnp.int32),
        jnp.zeros((1,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        scale=np.float32(scale),
        window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        kv_kind=np.int32(kv_kind(k_pages.dtype, q.dtype)),
        has_sinks=sinks is not None,
        bq=np.int32(bq),
    )
    return out


def native_tokens_pass(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    meta: jax.Array,
    num_blocks: int,
    **kw: Any,
) -> tuple[jax.Array, jax.Array]:
    """The reference's tokens pass (`paged_attention_jnp.TokensPass`) as one custom call:
    one-token blocks `meta` i32[4, NB] -> (out f[NB, Hq, D], dest i32[NB], T = none)."""
    t, hq, d = q.shape
    meta, num_blocks = pad_meta(meta, num_blocks, 1, t)
    out = _call(q, k_pages, v_pages, page_table, meta, 1, **kw).reshape(num_blocks, hq, d)
    return out.astype(q.dtype), jnp.where(meta[1] < meta[2], meta[1], t)


def native_blocks_pass(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    meta: jax.Array,
    num_blocks: int,
    *,
    bq: int,
    max_gather_elems: int,
    **kw: Any,
) -> tuple[jax.Array, jax.Array]:
    """The reference's block pass (`paged_attention_jnp.BlocksPass`) as one custom call: blocks
    `meta` i32[4, NB] of up to `bq` tokens -> (out f[NB * bq, Hq, D], dest i32[NB * bq])."""
    del max_gather_elems  # the kernel reads a page at a time
    t, hq, d = q.shape
    meta, num_blocks = pad_meta(meta, num_blocks, 1, t)
    out = _call(q, k_pages, v_pages, page_table, meta, bq, **kw).reshape(-1, hq, d)
    tok = meta[1][:, None] + jnp.arange(bq, dtype=jnp.int32)[None, :]
    dest = jnp.where(tok < meta[2][:, None], tok, t)
    return out.astype(q.dtype), dest.reshape(-1)


def paged_attention_cpu(
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
    max_gather_elems: int = 1 << 18,
    native_blocks: bool = True,
) -> jax.Array:
    """`paged_attention_reference` with its passes in the native kernel (the module docstring;
    `native_blocks=False` keeps the reference's block pass); the reference itself when the
    kernel is unavailable. Returns f[T, Hq, D] in q's dtype; padding tokens are zeros."""
    on = available()
    return paged_attention_reference(
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
        interpret=interpret,
        max_gather_elems=max_gather_elems,
        tokens_pass=native_tokens_pass if on else None,
        blocks_pass=native_blocks_pass if on and native_blocks else None,
    )
