"""int8 codes on the native block matmul: the 512-bit tile pairs equal the 256-bit tile bit for
bit, and the Q8-activation path (`x_q8`: x quantized per 32 values, AVX512-VNNI integer dot
products) against a float64 oracle of the same integer arithmetic."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_matmul_cpu as bm
from tests.native_kernels import need_native


def _require_kernel() -> None:
    need_native("block_matmul")  # fails in CI ($TOKENSPEED_JAX_REQUIRE_NATIVE) if unbuilt, else skips


def _blocks(k: int, n: int, block: int, mins: bool, seed: int):
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(rng.integers(0 if mins else -127, 16 if mins else 128, (k, n)), jnp.int8)
    scales = jnp.asarray(rng.random((k // block, n)) * 0.01, jnp.float32)
    m = jnp.asarray(rng.standard_normal((k // block, n)) * 0.01, jnp.float32) if mins else None
    return codes, scales, m


CASES = {  # name: (rows, K, N, block, mins)
    "q8_0_decode": (1, 576, 96, 32, False),
    "q4_1_rows_past_a_pass": (13, 576, 96, 32, True),
    "lone_last_tile": (5, 64, 48, 32, False),  # three 16-column tiles: a pair and one
    "per_channel": (6, 576, 64, 576, False),
    "per_channel_k_chunks": (3, 2080, 16, 2080, False),  # K chunks rounded to whole 32s
    "many_rows": (100, 128, 32, 32, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tile_pairs_equal_the_256_bit_tile_bit_for_bit(case):
    """Tile-major codes take Tile2<int8_t> with AVX-512 (12-row passes of two tiles), [K, N]
    codes the 256-bit tile: the same float32 operations per column."""
    _require_kernel()
    m, k, n, block, mins = CASES[case]
    codes, scales, mn = _blocks(k, n, block, mins, seed=m)
    x = jnp.asarray(np.random.default_rng(k).standard_normal((m, k)), jnp.float32)
    kn = np.asarray(bm.block_matmul_cpu(x, codes, scales, mn))
    tiled = np.asarray(bm.block_matmul_cpu(x, bm.pack_tiles(codes), scales, mn))
    np.testing.assert_array_equal(tiled, kn)


@pytest.mark.parametrize("case", sorted(CASES))
def test_q8_activations_match_the_integer_oracle(case):
    _require_kernel()
    if not bm.q8_available():
        pytest.skip("no AVX512-VNNI + VBMI here: x_q8 takes the float product (next test)")
    m, k, n, block, mins = CASES[case]
    codes, scales, mn = _blocks(k, n, block, mins, seed=m)
    x = jnp.asarray(np.random.default_rng(k).standard_normal((m, k)), jnp.float32)
    got = np.asarray(bm.block_matmul_cpu(x, bm.pack_tiles(codes), scales, mn, x_q8=True), np.float64)
    want = np.asarray(bm.block_matmul_q8_reference(x, codes, scales, mn), np.float64)
    # exact integer sums; float32 scaling and summation of K / 32 terms
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    # and it is not the float product: x was quantized (~0.4% of a dot product)
    flt = np.asarray(bm.block_matmul_reference(x, codes, scales, mn), np.float64)
    assert np.abs(got - flt).max() > 1e-5 * np.abs(flt).max()


def test_q8_without_vnni_or_tiles_is_the_float_product():
    """[K, N] codes (or a CPU without VNNI) ignore x_q8: the exact float product."""
    _require_kernel()
    codes, scales, _ = _blocks(64, 32, 32, False, seed=0)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(bm.block_matmul_cpu(x, codes, scales, x_q8=True)),
        np.asarray(bm.block_matmul_cpu(x, codes, scales)),
    )


def test_quantize_q8_reference():
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block: d = 0, codes 0
    q, d = (np.asarray(a) for a in bm.quantize_q8_reference(jnp.asarray(x)))
    assert q.dtype == np.int8 and q.shape == (3, 64) and d.shape == (3, 2)
    assert np.abs(q).max() == 127 and d[1, 0] == 0 and not q[1, :32].any()
    back = q.reshape(3, 2, 32) * d[..., None]
    assert (np.abs(back - x.reshape(3, 2, 32)) <= d[..., None] / 2 * (1 + 1e-6)).all()
