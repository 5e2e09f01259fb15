"""`dot`: `lax.dot_general` of activations x [..., K] with a weight matrix, where XLA:CPU gets a
lone row as two.

A one-row dot is lowered by XLA:CPU to a vector-matrix product that is much slower for
non-f32 operands: it upcasts a bf16 weight matrix to float32 on every call (SmolLM2 bf16 batch-1
decode: 205 weight converts a step, 4.1 tok/s), and its int8 path is ~8x slower than a two-row
matrix product (w8a8 SmolLM2 1-row step 328 ms against 39 in float32). A zero second row keeps
the library's matrix path and costs nothing visible.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["dot"]


def dot(x: jax.Array, w: jax.Array, w_axis: int, out_dtype: Any) -> jax.Array:
    """x [..., K] contracted with w on w's axis `w_axis` -> [..., N] in `out_dtype` (the
    accumulation type asked of the dot: f32 for floats, i32 for int8)."""
    one_row = x.size == x.shape[-1] and x.dtype != jnp.float32
    if one_row and jax.default_backend() == "cpu":
        x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        y = jax.lax.dot_general(x2, w, (((1,), (w_axis,)), ((), ())), preferred_element_type=out_dtype)[:1]
        return y.reshape(*x.shape[:-1], -1)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (w_axis,)), ((), ())), preferred_element_type=out_dtype)
