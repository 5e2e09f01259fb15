"""Linear weights kept in GGUF's block formats (`LLM("x.gguf", quantization="gguf")`, or any
model quantized to Q8_0 blocks at load: `quantization="q8_0"`).

llama.cpp's Q8_0, Q4_0 and Q4_1 split every row of a weight (an output channel, running over the
inputs) into blocks of 32 inputs with a float16 scale `d` each (and a float16 minimum `m` for
Q4_1): w = d * c (Q8_0: c int8; Q4_0: c = nibble - 8) or w = d * c + m (Q4_1: c = nibble). We
keep them in our `[in, out]` layout: codes int8[K, N] (one byte per weight, also for the 4-bit
formats: 4-bit packing is left to a kernel that can unpack in registers), scales f32[K/32, N],
mins f32[K/32, N] or absent. Memory per weight: 1.125 bytes (Q8_0, Q4_0), 1.25 (Q4_1), against
4 for the float32 copy the loader made before.

The product is the dequantized weights' (up to float32 summation order), computed inside the
jitted step:

    y[t, n] = sum_g d[g, n] * (sum_{k in g} x[t, k] * c[k, n]) + sum_g m[g, n] * xsum[t, g]

Three lowerings, chosen per shape at trace time like `models.quant`'s:
- native (XLA:CPU, up to `models.quant.NATIVE_MAX_ROWS` rows, when its C++ kernel builds): one
  custom call, `pallas_kernels.block_matmul_cpu`: code tiles converted in registers and read once
  per 6 rows, each block's sum of x * code scaled once (+ min * sum(x) for Q4_1). On 30 chained
  576 x 1536 Q4_1 layers (benchmarks/block_matmul.py): 1 row 4.2 ms against 9.8 split, 42.7
  float and 3.5 for a float32 copy; 16 rows 12.4 against 92.8 / 56.6 / 13.9; 128 rows 72-105
  against float's 85-99; 512 rows 322-334 against 243-259;
- split (XLA:CPU without a C++ compiler, up to SPLIT_MAX_ROWS rows): each token's activations as two int8 rows
  (`models.quant.split_rows`, ~16 bits), one int8 x int8 -> int32 dot batched over the blocks,
  scaled by d and summed over blocks; the Q4_1 term is a float [T, K/32] x [K/32, N] dot;
- float (larger steps, other backends): the weights dequantized inside the step, then one dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import block_matmul_cpu
from pallas_kernels.stacked import materialize
from tokenspeed_jax.models.quant import split_rows, use_native

BLOCK = 32  # inputs per block in Q8_0 / Q4_0 / Q4_1
# The split lowering's dot is batched over K/32 blocks of 32 inputs, which XLA:CPU runs well
# only for a few rows: 30 chained 576 x 1536 Q4 layers took 15 ms at 1 row against 59 for the
# float lowering (66 in float32), but 164 against 90 at 16 rows.
SPLIT_MAX_ROWS = 8


def check_blocks(codes: jax.Array, scales: jax.Array, mins: jax.Array | None) -> None:
    """ValueError naming the array whose shape or dtype does not fit `codes` int8[K, N]."""
    if codes.ndim != 2 or codes.dtype != jnp.int8 or codes.shape[0] % BLOCK:
        raise ValueError(
            f"{codes.shape=} {codes.dtype=}: block codes must be int8[K, N] with K a multiple of {BLOCK}"
        )
    want = (codes.shape[0] // BLOCK, codes.shape[1])
    for name, a in (("scales", scales), ("mins", mins)):
        if a is not None and tuple(a.shape) != want:
            raise ValueError(f"{name}.shape={tuple(a.shape)}: expected {want} for {codes.shape=}")


def quantize_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w f[K, N] -> Q8_0 blocks (codes int8[K, N], scales f32[K/32, N]): per block of 32
    inputs, d = absmax / 127 and c = round(w / d), as llama.cpp's quantize_row_q8_0."""
    k, n = w.shape
    if k % BLOCK:
        raise ValueError(f"{w.shape=}: Q8_0 blocks need the input size to be a multiple of {BLOCK}")
    wb = jnp.asarray(w, jnp.float32).reshape(k // BLOCK, BLOCK, n)
    d = jnp.max(jnp.abs(wb), axis=1) / 127.0
    codes = jnp.round(wb / jnp.where(d == 0, 1.0, d)[:, None, :])
    return jnp.clip(codes, -127, 127).astype(jnp.int8).reshape(k, n), d


def dequantize_blocks(
    codes: jax.Array, scales: jax.Array, mins: jax.Array | None, dtype=jnp.float32
) -> jax.Array:
    """The float weights f[K, N] of the blocks (the reference, and the float lowering)."""
    k, n = codes.shape
    w = codes.astype(jnp.float32).reshape(k // BLOCK, BLOCK, n) * scales[:, None, :]
    if mins is not None:
        w = w + mins[:, None, :]
    return w.reshape(k, n).astype(dtype)


def block_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, mins: jax.Array | None) -> jax.Array:
    """x f[..., K] @ dequantize_blocks(codes, scales, mins) f[K, N], in x's dtype; codes
    int8[K, N] or tile-major [N / 16, K, 16]."""
    rows = x.size // x.shape[-1]
    if use_native(rows):
        return block_matmul_cpu.block_matmul_cpu(x, codes, scales, mins, out_dtype=x.dtype)
    codes, scales, mins = (materialize(a) for a in (codes, scales, mins))  # scan_layers' slices
    # tile-major codes (`Linear.tile`) past NATIVE_MAX_ROWS: the float lowering, re-laid in the
    # same fusion as the dequantization
    codes = block_matmul_cpu.unpack_tiles(codes)
    k, n = codes.shape
    if rows > SPLIT_MAX_ROWS or jax.default_backend() != "cpu":
        w = dequantize_blocks(codes, scales, mins, x.dtype)
        y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    g = k // BLOCK
    x32 = x.astype(jnp.float32).reshape(rows, k)
    xq, s1, s2 = split_rows(x32)  # int8[2 * rows, K], f32[rows, 1] twice
    acc = jax.lax.dot_general(
        xq.reshape(2 * rows, g, BLOCK),
        codes.reshape(g, BLOCK, n),
        (((2,), (1,)), ((1,), (0,))),
        preferred_element_type=jnp.int32,
    ).astype(jnp.float32)  # [G, 2R, N]
    y = jnp.sum((acc[:, :rows] * s1 + acc[:, rows:] * s2) * scales[:, None, :], axis=0)
    if mins is not None:
        y = y + jnp.dot(jnp.sum(x32.reshape(rows, g, BLOCK), axis=-1), mins)
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)
