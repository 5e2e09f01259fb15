"""pool_bits: bf16 / f16 page pools stored as uint16 bits on the reference path.

Reads and writes are bit-exact against a pool of the float dtype (NaN payloads and -0.0
included, out-of-range rows dropped), and the reason it exists holds: XLA:CPU compiles a plain
bf16 scatter with a float32 copy of the whole pool, the uint16 pool without any pool-sized
float array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import pool_bits

HALF = [jnp.bfloat16, jnp.float16]


def _pool(dtype, shape=(12, 4, 3)):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x[1, 2, 0], x[3, 0, 1] = np.nan, -0.0
    return jnp.asarray(x).astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def test_storage_dtype_and_holds():
    assert pool_bits.storage_dtype(jnp.bfloat16) == jnp.uint16
    assert pool_bits.storage_dtype(jnp.float16) == jnp.uint16
    assert pool_bits.storage_dtype(jnp.float32) == jnp.float32
    assert pool_bits.holds(jnp.uint16, jnp.bfloat16) and pool_bits.holds(jnp.float32, jnp.float32)
    assert not pool_bits.holds(jnp.uint16, jnp.float32)
    assert not pool_bits.holds(jnp.bfloat16, jnp.float32)


@pytest.mark.parametrize("dtype", HALF)
def test_take_from_bits_is_bit_exact(dtype):
    pool = _pool(dtype)
    stored = jax.lax.bitcast_convert_type(pool, jnp.uint16)
    for idx in (jnp.asarray([3, 1, 1, 0, 11]), (jnp.asarray([1, 3, 5]), jnp.asarray([2, 0, 3]))):
        got = pool_bits.take(stored, idx, dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(_bits(got), _bits(pool[idx]))


def test_take_from_a_float_pool_is_plain_indexing():
    pool = _pool(jnp.float32)
    idx = jnp.asarray([2, 0, 2])
    np.testing.assert_array_equal(_bits(pool_bits.take(pool, idx, jnp.float32)), _bits(pool[idx]))


@pytest.mark.parametrize("dtype", HALF)
def test_scatter_into_bits_is_bit_exact_and_drops_out_of_range(dtype):
    pool = _pool(dtype)
    stored = jax.lax.bitcast_convert_type(pool, jnp.uint16)
    idx = jnp.asarray([2, 12, 5, 40], jnp.int32)  # 12 and 40: out of range, dropped
    vals = (_pool(jnp.float32, (4, 4, 3)) * 3).astype(dtype)
    got = pool_bits.scatter_set(stored, idx, vals)
    assert got.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(got), _bits(pool.at[idx].set(vals, mode="drop")))


def test_scatter_into_a_float_pool_casts_and_bits_refuse_other_values():
    pool = _pool(jnp.float32)
    got = pool_bits.scatter_set(pool, jnp.asarray([1]), jnp.ones((1, 4, 3), jnp.bfloat16))
    assert got.dtype == jnp.float32 and float(got[1].sum()) == 12.0
    with pytest.raises(ValueError, match="uint16 pool holds 16-bit float bits"):
        pool_bits.scatter_set(jnp.zeros((4, 2), jnp.uint16), jnp.asarray([0]), jnp.ones((1, 2), jnp.float32))


def _pool_sized(fn, pool, dtype: str) -> int:
    """Arrays of `dtype` with the pool's shape in the compiled program."""
    text = jax.jit(fn).lower(pool).compile().as_text()
    return text.count(f"{dtype}[{','.join(map(str, pool.shape))}]")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's bf16 normalization")
def test_a_bits_pool_is_never_converted_or_copied():
    shape, idx = (256, 16, 64), jnp.arange(8, dtype=jnp.int32) * 3
    rows = jnp.ones((8, 16, 64), jnp.bfloat16)
    stored = jnp.zeros(shape, jnp.uint16)

    def write_read(p):
        p = pool_bits.scatter_set(p, idx, rows)
        return p, pool_bits.take(p, idx, jnp.bfloat16).astype(jnp.float32).sum()

    assert _pool_sized(write_read, stored, "f32") == 0
    assert _pool_sized(write_read, stored, "bf16") == 0
    # what a bf16 pool compiles to here (the reason for storing bits)
    plain = jnp.zeros(shape, jnp.bfloat16)
    assert _pool_sized(lambda p: p.at[idx].set(rows, mode="drop"), plain, "f32") > 0


def test_references_read_bits_pools_like_float_pools():
    """paged_attention_reference / short_conv_reference given a bf16 pool or its uint16 bits:
    identical outputs, NaN garbage in the null page and in unused pages included."""
    from pallas_kernels import paged_attention_reference, short_conv_reference

    rng = np.random.default_rng(1)
    pages, bs, hkv, d, t = 8, 4, 2, 16, 3
    k = jnp.asarray(rng.standard_normal((pages, bs, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((pages, bs, hkv, d)), jnp.bfloat16)
    k, v = (a.at[0].set(jnp.nan).at[7].set(jnp.nan) for a in (k, v))
    q = jnp.asarray(rng.standard_normal((t, 4, d)), jnp.bfloat16)
    table = jnp.asarray([[1, 2, 0, 4, 5]], jnp.int32)  # a hole at column 2
    meta = (jnp.asarray([18], jnp.int32), jnp.asarray([0, t], jnp.int32), jnp.asarray([1], jnp.int32))
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)  # noqa: E731
    for window in (None, 6):
        want = paged_attention_reference(q, k, v, table, *meta, sliding_window=window)
        got = paged_attention_reference(q, bits(k), bits(v), table, *meta, sliding_window=window)
        np.testing.assert_array_equal(_bits(got), _bits(want))

    c = 8
    conv = jnp.asarray(rng.standard_normal((pages, bs, c)), jnp.bfloat16).at[0].set(jnp.nan)
    x = jnp.asarray(rng.standard_normal((t, c)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, c)), jnp.bfloat16)
    want = short_conv_reference(x, conv, table, *meta, w)
    got = short_conv_reference(x, bits(conv), table, *meta, w)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert not np.isnan(np.asarray(got, np.float32)).any()
