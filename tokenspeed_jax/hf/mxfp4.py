"""MXFP4 dequantization of the published GPT-OSS expert weights.

Format (OCP microscaling FP4): `blocks u8[..., R, G, 16]` pack 32 FP4 (e2m1) values per group,
low nibble first; `scales u8[..., R, G]` are one shared power-of-two exponent per group, biased by
127. Value = e2m1(nibble) * 2^(scale - 127). The packed layout is [out, in] per expert; the result
is returned transposed to [..., in, out] (`[E, H, 2I]` for gate_up, `[E, I, H]` for down), the
layout transformers' own bf16 GPT-OSS checkpoints use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# e2m1 code -> value: sign bit 3, exponent bits 2..1, mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """blocks u8[*P, R, G, B], scales u8[*P, R, G] -> f[*P, G*B*2, R] (see module docstring)."""
    blocks = jnp.asarray(blocks, jnp.uint8)
    scales = jnp.asarray(scales).astype(jnp.int32) - 127
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    lut = jnp.asarray(E2M1_VALUES, jnp.float32)
    lo = lut[(blocks & 0x0F).astype(jnp.int32)]
    hi = lut[(blocks >> 4).astype(jnp.int32)]
    vals = jnp.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    vals = jnp.ldexp(vals, scales[..., None])  # exact: multiplies by a power of two
    *prefix, r, g, b2 = vals.shape
    out = vals.reshape(*prefix, r, g * b2)
    return jnp.swapaxes(out, -1, -2).astype(dtype)
