"""pool_bits: 16-bit float gathers / scatters moved as uint16 bits.

Bit-exact against the plain indexing ops (NaN payloads and -0.0 included, out-of-range scatter
rows dropped), and the reason it exists: XLA:CPU compiles a plain bf16 scatter / gather with a
float32 copy of the whole array, the bits version without one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import pool_bits

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32]


def _pool(dtype, shape=(12, 4, 3)):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x[1, 2, 0], x[3, 0, 1] = np.nan, -0.0
    return jnp.asarray(x).astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_take_is_bit_exact(dtype):
    pool = _pool(dtype)
    idx = jnp.asarray([3, 1, 1, 0, 11], jnp.int32)
    np.testing.assert_array_equal(_bits(pool_bits.take(pool, idx)), _bits(pool[idx]))
    tup = (jnp.asarray([1, 3, 5]), jnp.asarray([2, 0, 3]))
    np.testing.assert_array_equal(_bits(pool_bits.take(pool, tup)), _bits(pool[tup]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_set_is_bit_exact_and_drops_out_of_range(dtype):
    pool = _pool(dtype)
    idx = jnp.asarray([2, 12, 5, 40], jnp.int32)  # 12 and 40: out of range, dropped
    vals = _pool(jnp.float32, (4, 4, 3)) * 3  # float32 values cast to the pool's dtype
    got = pool_bits.scatter_set(pool, idx, vals)
    want = pool.at[idx].set(vals.astype(dtype), mode="drop")
    assert got.dtype == pool.dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _f32_pool_copies(fn, pool) -> int:
    """float32 arrays of the pool's shape in the compiled program (XLA:CPU's upcasts)."""
    text = jax.jit(fn).lower(pool).compile().as_text()
    shape = ",".join(map(str, pool.shape))
    return text.count(f"f32[{shape}]")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's bf16 normalization")
def test_bf16_pool_is_never_copied_to_float32():
    pool = jnp.zeros((256, 16, 64), jnp.bfloat16)
    idx = jnp.arange(8, dtype=jnp.int32) * 3
    rows = jnp.ones((8, 16, 64), jnp.bfloat16)
    assert _f32_pool_copies(lambda p: pool_bits.scatter_set(p, idx, rows), pool) == 0
    assert _f32_pool_copies(lambda p: pool_bits.take(p, idx).astype(jnp.float32).sum(), pool) == 0
    # what the plain ops compile to here (the reason for pool_bits)
    assert _f32_pool_copies(lambda p: p.at[idx].set(rows, mode="drop"), pool) > 0
