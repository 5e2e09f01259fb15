"""Gathers and scatters of 16-bit float arrays moved as their integer bits.

XLA:CPU has no bfloat16 / float16 gather or scatter: its float normalization upcasts the whole
operand to float32 around each one (and converts the result back). For a bf16 page pool that is a
full float32 copy of every layer's pool on every K/V write and every page read: a SmolLM2 bf16
decode step of 16 tokens took 884 ms against 139 ms in float32 (benchmarks/README.md, "bfloat16
on XLA:CPU"). Moving the same 16 bits as uint16 is exact, native on every backend, and the
bitcasts around it cost nothing. Other dtypes go through unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def _bits(dtype: Any) -> Any:
    """uint16 for a 16-bit float dtype, else None."""
    dtype = jnp.dtype(dtype)
    return jnp.uint16 if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) else None


def take(table: jax.Array, index: Any) -> jax.Array:
    """`table[index]` (any numpy-style index: arrays, tuples of arrays)."""
    bits = _bits(table.dtype)
    if bits is None:
        return table[index]
    return lax.bitcast_convert_type(lax.bitcast_convert_type(table, bits)[index], table.dtype)


def scatter_set(array: jax.Array, index: Any, values: jax.Array, *,
                mode: str = "drop") -> jax.Array:
    """`array.at[index].set(values.astype(array.dtype), mode=mode)`."""
    values = values.astype(array.dtype)
    bits = _bits(array.dtype)
    if bits is None:
        return array.at[index].set(values, mode=mode)
    out = lax.bitcast_convert_type(array, bits).at[index].set(
        lax.bitcast_convert_type(values, bits), mode=mode)
    return lax.bitcast_convert_type(out, array.dtype)
