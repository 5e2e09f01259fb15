"""Page pools of 16-bit (and 8-bit) floats stored as their unsigned bits (the CPU reference path).

XLA:CPU has no bfloat16 / float16 scatter: float normalization upcasts the whole operand to
float32 and back around each one, so a bf16 pool costs a full float32 copy of every layer's pool
on every K/V write (SmolLM2 bf16, a 16-token decode step: 884 ms against 139 ms in float32). A
`bitcast_convert_type` of the whole pool is no way out either: XLA:CPU materializes it as a copy
too. So the runtime stores such pools as uint16 from the start (`storage_dtype`): writes bitcast
the few new rows to uint16, reads gather uint16 rows and bitcast only those back. Both are exact;
no pool-sized array is ever converted or copied. Float pools (float32, or 16-bit pools handed to
the Pallas kernels) go through the plain ops unchanged. The 8-bit float KV cache
(`kv_quant`, fp8_e4m3) is kept the same way, as uint8.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

BITS = jnp.dtype(jnp.uint16)
BITS8 = jnp.dtype(jnp.uint8)
_BITS_OF_SIZE = {2: BITS, 1: BITS8}


def is_half(dtype: Any) -> bool:
    """True for a 16-bit float dtype (bfloat16, float16)."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


def _bits_of(dtype: Any) -> jnp.dtype | None:
    """uint16 / uint8 for a 16- / 8-bit float dtype, else None."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    return _BITS_OF_SIZE.get(dtype.itemsize)


def storage_dtype(dtype: Any) -> jnp.dtype:
    """The pool dtype that holds values of `dtype` on the reference path: uint16 for 16-bit
    floats, uint8 for 8-bit floats, else `dtype` itself."""
    bits = _bits_of(dtype)
    out: jnp.dtype = bits if bits is not None else jnp.dtype(dtype)
    return out


def holds(pool_dtype: Any, dtype: Any) -> bool:
    """True when a pool of `pool_dtype` holds values of `dtype` (itself, or its bits)."""
    return bool(jnp.dtype(pool_dtype) == jnp.dtype(dtype) or jnp.dtype(pool_dtype) == _bits_of(dtype))


def take(pool: jax.Array, index: Any, dtype: Any) -> jax.Array:
    """`pool[index]` as values of `dtype` (any numpy-style index); bits rows are bitcast."""
    rows = pool[index]
    if rows.dtype != jnp.dtype(dtype) and rows.dtype == _bits_of(dtype):
        return lax.bitcast_convert_type(rows, dtype)
    return rows


def scatter_set(pool: jax.Array, index: Any, values: jax.Array, *, mode: str = "drop") -> jax.Array:
    """`pool.at[index].set(values, mode=mode)`; a uint16 / uint8 pool takes 16- / 8-bit float
    values as their bits, any other pool takes `values.astype(pool.dtype)`."""
    if pool.dtype in (BITS, BITS8):
        if _bits_of(values.dtype) != pool.dtype:
            raise ValueError(
                f"{values.dtype=}: a {pool.dtype} pool holds {8 * pool.dtype.itemsize}-bit float bits"
            )
        return pool.at[index].set(lax.bitcast_convert_type(values, pool.dtype), mode=mode)
    return pool.at[index].set(values.astype(pool.dtype), mode=mode)
