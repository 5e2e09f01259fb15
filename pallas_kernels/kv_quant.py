"""Quantized KV cache: int8 / fp8 (e4m3) K and V pages with a scale per token per KV head.

Layout (beside the float layout of `paged_attention`):
  k_pages, v_pages  [P, page_size, Hkv, D]  int8, or float8_e4m3fn (the reference backend keeps
                    fp8 as its uint8 bits, `pool_bits`)
  k_scales, v_scales f16[P, page_size, Hkv] (uint16 bits on the reference backend)
Value = page value * scale. A scale covers one token of one head (vLLM's per-token-head
scales), so it is written with its row, in the same paged layout, by the same scatter: no
calibration pass, no cross-token state, and a page freed and reused needs nothing reset.

Why 16-bit scales: a row of D int8 values plus an f16 scale is D + 2 bytes against 2D in bf16
(1.94x the pages at D=64, 1.97x at D=128); an f32 scale would give 1.88x at D=64. The scale is
rounded to f16 *before* the values are divided by it, so dequantization uses exactly the scale
the values were made with (the rounding only moves where the 127 / 448 ends fall, and the
values are clipped there).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import pool_bits

__all__ = [
    "KV_CACHE_DTYPES",
    "SCALE_DTYPE",
    "bytes_per_row",
    "dequantize",
    "quantize",
    "quantized_dtype",
    "value_dtype",
]

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
SCALE_DTYPE = jnp.dtype(jnp.float16)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
_INT8 = jnp.dtype(jnp.int8)
_QMAX = {_INT8: 127.0, FP8: 448.0}
_TINY = 2.0**-24  # the smallest f16 subnormal: an all-zero row gets a scale, never 0 / 0


def quantized_dtype(kv_cache_dtype: str) -> jnp.dtype | None:
    """The page values' dtype for `kv_cache_dtype` ("auto" -> None: pools in the model dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    out: jnp.dtype | None = {"auto": None, "int8": _INT8, "fp8_e4m3": FP8}[kv_cache_dtype]
    return out


def value_dtype(pool_dtype: Any) -> jnp.dtype | None:
    """The quantized values a pool of `pool_dtype` holds: int8, float8_e4m3fn (as itself or as
    uint8 bits), or None for a float pool."""
    dt = jnp.dtype(pool_dtype)
    out: jnp.dtype | None = None
    if dt == _INT8:
        out = _INT8
    elif dt in (FP8, pool_bits.BITS8):
        out = FP8
    return out


def bytes_per_row(kv_cache_dtype: str, model_dtype: Any, head_dim: int) -> int:
    """Pool bytes of one cached K (or V) row of one head: D values, plus its scale."""
    q = quantized_dtype(kv_cache_dtype)
    if q is None:
        return int(head_dim * jnp.dtype(model_dtype).itemsize)
    return int(head_dim * q.itemsize + SCALE_DTYPE.itemsize)


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """x f[..., D] -> (values dtype[..., D], scales f16[...]): per-row absmax scaling.

    int8: round-to-nearest of x / scale in [-127, 127]; fp8_e4m3: x / scale in [-448, 448],
    rounded by the cast. NaN / inf in x give a non-finite scale (as a float cache would carry
    them); zeros give zeros."""
    dtype = jnp.dtype(dtype)
    if dtype not in _QMAX:
        raise ValueError(f"{dtype=}: quantized KV values are int8 or float8_e4m3fn")
    qmax = _QMAX[dtype]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.maximum(amax / qmax, _TINY).astype(SCALE_DTYPE)
    y = jnp.clip(xf / scale.astype(jnp.float32)[..., None], -qmax, qmax)
    if dtype == _INT8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize(values: jax.Array, scales: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """values [..., D] (int8 / fp8) and scales [...] (f16) -> dtype[..., D]."""
    out = values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]
    return out.astype(dtype)
