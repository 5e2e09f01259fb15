"""`block_matmul_cpu` / `dense_matmul_cpu`: x @ (GGUF-style block-quantized, or float32 /
bfloat16) weights on XLA:CPU, in native code.

The weights are llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks in the `[in, out]` layout of
`tokenspeed_jax.models.block_quant`: codes int8[K, N] (one byte per weight), scales f32[K/B, N],
optional mins f32[K/B, N]; W[k, n] = scales[k // B, n] * codes[k, n] (+ mins[k // B, n]).
One C++ custom call (`pallas_kernels/native/block_matmul.cc`) converts 16-column tiles of codes
in registers and reuses each for 6 rows of x, split over XLA's intra-op threads: a few rows
(decode) read one byte per weight, where the jnp lowerings read a float copy or run a batched
int8 dot that XLA:CPU does well only for a row or two. `dense_matmul_cpu` is the same kernel on
float32 / bfloat16 weights (one block of all K inputs, scale 1: an exact float32 product in
another summation order).
Either takes its weight as [K, N] or tile-major [N / 16, K, 16] (`pack_tiles`): a tile's K rows
contiguous, so a few-row product streams memory in order. Tiled, 30 chained 576 x 1536 layers
(benchmarks/block_matmul.py, 2-vCPU AVX2 VM): bf16 at 1 row 2.2 ms against 4.9 strided and 6.7
for XLA's bf16 dot; float32 at 1 / 16 / 512 rows 3.2 / 9.2 / 176 ms against XLA's 4.3 / 19.5 /
180. The model re-lays its Linears so on one CPU device (`models.layers.tile_linears`).
`*_reference` are the same products as XLA's float dot.
"""

from __future__ import annotations

import ctypes
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.stacked import LayerSlice, Weight, materialize, whole

__all__ = [
    "AMX_MODEL_TARGET",
    "TARGET",
    "TILE",
    "amx_calls",
    "available",
    "block_matmul_cpu",
    "block_matmul_q8_reference",
    "block_matmul_reference",
    "dense_matmul_amx_model",
    "dense_matmul_cpu",
    "dense_matmul_reference",
    "pack_tiles",
    "q8_available",
    "quantize_q8_reference",
    "tileable",
    "unpack_tiles",
    "weight_shape",
]

TARGET = "tokenspeed_block_matmul"
# the same kernel built on the software model of the AMX tiles (native/amx_tiles.h)
AMX_MODEL_TARGET = "tokenspeed_block_matmul_amx_model"
TILE = 16  # columns per tile of the kernel (kCols in block_matmul.cc)


def available() -> bool:
    """Whether the native kernel is built and registered in this process (builds it once)."""
    return native.load("block_matmul") is not None


def tileable(w: jax.Array) -> bool:
    """Whether `pack_tiles` takes w: a [K, N] matrix with N a multiple of TILE."""
    return w.ndim == 2 and w.shape[1] % TILE == 0


def pack_tiles(w: jax.Array) -> jax.Array:
    """w [K, N] -> tile-major [N / TILE, K, TILE]: each 16-column tile's K rows contiguous.

    The kernel walks a tile down K; in the [K, N] layout every K row of a tile is another cache
    line N elements away, which caps a few-row (decode) product near half the memory bandwidth
    (30 chained bf16 576 x 1536 layers, 1 row: ~10 GB/s strided against ~35 tile-major)."""
    if not tileable(w):
        raise ValueError(f"{w.shape=}: pack_tiles takes [K, N] with N a multiple of {TILE}")
    k, n = w.shape
    return w.reshape(k, n // TILE, TILE).transpose(1, 0, 2)


def unpack_tiles(w: jax.Array) -> jax.Array:
    """The inverse of `pack_tiles`: [N / TILE, K, TILE] -> [K, N]; [K, N] is returned as is."""
    if w.ndim == 2:
        return w
    if w.ndim != 3 or w.shape[2] != TILE:
        raise ValueError(f"{w.shape=}: expected [K, N] or tile-major [N / {TILE}, K, {TILE}]")
    return w.transpose(1, 0, 2).reshape(w.shape[1], w.shape[0] * TILE)


def weight_shape(w: Weight) -> tuple[int, int]:
    """(K, N) of a [K, N] or tile-major weight."""
    if w.ndim == 3 and w.shape[2] == TILE:
        return int(w.shape[1]), int(w.shape[0]) * TILE
    if w.ndim != 2:
        raise ValueError(f"{w.shape=}: expected [K, N] or tile-major [N / {TILE}, K, {TILE}]")
    return int(w.shape[0]), int(w.shape[1])


def _check_x(x: jax.Array, w: jax.Array) -> None:
    k = weight_shape(w)[0]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"{x.shape=}: the last axis must be K = {k} ({w.shape=})")


def _check(x: jax.Array, codes: jax.Array, scales: jax.Array, mins: jax.Array | None) -> int:
    """ValueError naming what does not fit; returns the block size B."""
    if codes.dtype != jnp.int8:
        raise ValueError(
            f"{codes.shape=} {codes.dtype=}: codes must be int8[K, N] (or tile-major [N / {TILE}, K, {TILE}])"
        )
    _check_x(x, codes)
    k, n = weight_shape(codes)
    if scales.ndim != 2 or scales.shape[1] != n or scales.shape[0] < 1 or k % scales.shape[0]:
        raise ValueError(f"{scales.shape=}: expected [K / B, N] for {codes.shape=}")
    if mins is not None and mins.shape != scales.shape:
        raise ValueError(f"{mins.shape=}: expected {scales.shape=}")
    return k // int(scales.shape[0])


def block_matmul_reference(
    x: jax.Array, codes: jax.Array, scales: jax.Array, mins: jax.Array | None = None
) -> jax.Array:
    """x f[..., K] @ W -> f32[..., N], W the dequantized blocks (float32, HIGHEST precision)."""
    block = _check(x, codes, scales, mins)
    codes = unpack_tiles(codes)
    k, n = codes.shape
    w = codes.astype(jnp.float32).reshape(k // block, block, n) * scales[:, None, :]
    if mins is not None:
        w = w + mins[:, None, :]
    return jnp.matmul(x.astype(jnp.float32), w.reshape(k, n), precision=jax.lax.Precision.HIGHEST)


def block_matmul_cpu(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    mins: jax.Array | None = None,
    *,
    x_q8: bool = False,
    out_dtype: Any = jnp.float32,
) -> jax.Array:
    """x f[..., K] @ W -> out_dtype[..., N] as one native call (the reference
    when it cannot be built). x is computed in float32; codes int8[K, N]; scales / mins
    f32[K / B, N].

    `x_q8`: x quantized per 32 values to int8, as llama.cpp's quantized products do
    (`quantize_q8_reference`), for integer dot products (AVX512-VNNI) on tile-major codes with
    K a multiple of 32 where this CPU has them (`q8_available`): `block_matmul_q8_reference`'s
    result up to float32 summation order. Elsewhere the float product, as without it."""
    block = _check(x, codes, scales, mins)
    if not available():
        codes, scales, mins = (materialize(a) for a in (codes, scales, mins))
        return block_matmul_reference(x, codes, scales, mins).astype(out_dtype)
    return _native_call(x, codes, scales, mins, block, x_q8=x_q8, out_dtype=out_dtype)


def q8_available() -> bool:
    """Whether `block_matmul_cpu(..., x_q8=True)` takes integer dot products here."""
    lib = native.load("block_matmul")
    return lib is not None and bool(lib.TokenspeedHaveQ8())


def quantize_q8_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x f32[M, K] (K a multiple of 32) -> (q int8[M, K], d f32[M, K / 32]): per 32 values
    d = max|x| / 127 and q = round-half-even(x * (1 / d)) (0 where d = 0), llama.cpp's Q8 blocks
    and the kernel's (the same float32 operations, so the same codes)."""
    m, k = x.shape
    xb = x.astype(jnp.float32).reshape(m, k // 32, 32)
    d = jnp.max(jnp.abs(xb), axis=-1) / jnp.float32(127.0)
    inv = jnp.where(d != 0, jnp.float32(1.0) / jnp.where(d != 0, d, 1.0), 0.0)
    q = jnp.clip(jnp.round(xb * inv[..., None]), -127, 127).astype(jnp.int8)
    return q.reshape(m, k), d


def block_matmul_q8_reference(
    x: jax.Array, codes: jax.Array, scales: jax.Array, mins: jax.Array | None = None
) -> jax.Array:
    """What `block_matmul_cpu(..., x_q8=True)` computes: sum over 32-value blocks j of
    d_x[j] * (xq . codes)[j] (exact integers), times the weight blocks' scales, plus
    mins * sum(x) (float x, exact) for Q4_1; float64 sums here (an oracle)."""
    block = _check(x, codes, scales, mins)
    codes = unpack_tiles(codes)
    k, n = codes.shape
    rows = x.reshape(-1, k).astype(jnp.float32)
    q, d = (np.asarray(a) for a in quantize_q8_reference(rows))
    c = np.asarray(codes, np.int64).reshape(k // 32, 32, n)
    isum = np.einsum("mgk,gkn->mgn", q.reshape(-1, k // 32, 32).astype(np.int64), c)
    part = (isum * d[..., None].astype(np.float64)).reshape(-1, k // block, block // 32, n).sum(2)
    y = np.einsum("mgn,gn->mn", part, np.asarray(scales, np.float64))
    if mins is not None:
        xs = np.asarray(rows, np.float64).reshape(-1, k // block, block).sum(-1)
        y = y + xs @ np.asarray(mins, np.float64)
    return jnp.asarray(y.reshape(*x.shape[:-1], n), jnp.float32)


def _native_call(
    x: jax.Array,
    codes: Weight,
    scales: Weight,
    mins: Weight | None,
    block: int,
    target: str = TARGET,
    x_q8: bool = False,
    out_dtype: Any = jnp.float32,
) -> jax.Array:
    """The custom call on x's rows flattened to [M, K]; out_dtype[..., N]. A bfloat16 x goes in
    as it is (the kernel converts it where a path wants float32: one pass of XLA's over the
    activations saved), and with bfloat16 weights tells the kernel its values are bf16
    (`x_bf16`: the AVX512-BF16 dot product and the AMX tiles take them, exactly). A bf16 y is
    rounded from the float32 accumulators by the kernel; other dtypes are converted from its
    float32 y."""
    k, n = weight_shape(codes)
    rows = x.reshape(-1, k)
    if rows.dtype != jnp.bfloat16:
        rows = rows.astype(jnp.float32)
    written = jnp.bfloat16 if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32
    # LayerSlice operands (scan_layers): the stacks go in whole with the layer index
    slices: list[Weight | None] = [codes, scales, mins]
    layer = next((a.index for a in slices if isinstance(a, LayerSlice)), jnp.int32(0))
    if mins is not None and isinstance(mins, LayerSlice) != isinstance(scales, LayerSlice):
        scales, mins = materialize(scales), materialize(mins)  # the kernel offsets both or neither
    scales_arr, mins_arr = whole(scales), whole(mins)
    assert scales_arr is not None
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0], n), written))
    y: jax.Array = call(
        rows,
        whole(codes),
        scales_arr.astype(jnp.float32),
        jnp.zeros((1,), jnp.float32) if mins_arr is None else mins_arr.astype(jnp.float32),
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        block=np.int32(block),
        has_mins=mins is not None,
        tiled=codes.ndim == 3,
        x_bf16=bool(x.dtype == jnp.bfloat16 and codes.dtype == jnp.bfloat16),
        x_q8=bool(x_q8),
        codes_stacked=isinstance(codes, LayerSlice),
        scales_stacked=isinstance(scales, LayerSlice),
    )
    return y.reshape(*x.shape[:-1], n).astype(out_dtype)


def _check_dense(x: jax.Array, w: jax.Array) -> None:
    if w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(
            f"{w.shape=} {w.dtype=}: w must be float32 or bfloat16 [K, N] "
            f"(or tile-major [N / {TILE}, K, {TILE}])"
        )
    _check_x(x, w)


def dense_matmul_reference(x: jax.Array, w: jax.Array, out_dtype: Any = jnp.float32) -> jax.Array:
    """x f[..., K] @ w f32 / bf16[K, N] -> out_dtype[..., N] (float32, HIGHEST precision, then
    rounded to out_dtype)."""
    _check_dense(x, w)
    y = jnp.matmul(
        x.astype(jnp.float32), unpack_tiles(w).astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return y.astype(out_dtype)


def dense_matmul_cpu(x: jax.Array, w: jax.Array, out_dtype: Any = jnp.float32) -> jax.Array:
    """x f[..., K] @ w f32 / bf16[K, N] -> out_dtype[..., N] as one native call
    (the reference when it cannot be built); accumulated in float32."""
    _check_dense(x, w)
    if not available():
        return dense_matmul_reference(x, materialize(w), out_dtype)
    k, n = weight_shape(w)
    return _native_call(x, w, jnp.ones((1, n), jnp.float32), None, k, out_dtype=out_dtype)


def amx_calls(model: bool = False) -> int:
    """How many products ran on AMX tiles in this process: the hardware's (`block_matmul`,
    on a CPU with AMX-BF16), or the software model's (`model`); 0 when not built."""
    lib = native.load("block_matmul_amx_model" if model else "block_matmul")
    if lib is None:
        return 0
    calls = lib.TokenspeedAmxCalls
    calls.restype = ctypes.c_int64
    return int(calls())


def dense_matmul_amx_model(x: jax.Array, w: jax.Array, out_dtype: Any = jnp.float32) -> jax.Array:
    """`dense_matmul_cpu` on the software model of the AMX tiles: bf16 x with bf16 weights take
    the tile product (amx_matmul.h) at every row count, on any CPU, so tests check its packing,
    pairs, padding and edges against an oracle where no AMX exists. RuntimeError when the
    kernel cannot be built (there is no fallback to test)."""
    _check_dense(x, w)
    if native.load("block_matmul_amx_model") is None:
        raise RuntimeError(f"AMX model kernel: {native.unavailable('block_matmul_amx_model')}")
    k, n = weight_shape(w)
    return _native_call(
        x, w, jnp.ones((1, n), jnp.float32), None, k, target=AMX_MODEL_TARGET, out_dtype=out_dtype
    )
