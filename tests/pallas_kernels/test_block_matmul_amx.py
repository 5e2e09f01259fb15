"""The AMX tile product of bf16 weights and bf16 activations (native/amx_matmul.h) against a
float64 oracle: on the software model of the tiles (native/amx_tiles.h) on every CPU, and on the
hardware when this CPU has AMX-BF16; the hardware build compiles everywhere (-march=sapphirerapids)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_matmul_cpu, native
from tests.native_kernels import need_native


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


def _require(kernel: str) -> None:
    need_native(kernel)  # fails in CI ($TOKENSPEED_JAX_REQUIRE_NATIVE) if unbuilt, else skips


@pytest.fixture(params=["model", "hardware"])
def amx(request):
    """(dense matmul on the tiles, whether the product ran on them: calls before -> bool)."""
    if request.param == "model":
        _require("block_matmul_amx_model")
        return block_matmul_cpu.dense_matmul_amx_model, True
    if not _has_amx():
        pytest.skip("no AMX-BF16 on this CPU (the model runs the same source)")
    _require("block_matmul")
    return block_matmul_cpu.dense_matmul_cpu, False


CASES = {  # name: (rows of x, K, N, tile-major)
    "one_row": (1, 64, 32, True),
    "one_tile_of_rows": (16, 64, 32, True),
    "rows_past_a_tile": (17, 40, 48, True),  # K padded to 64; a lone last column tile
    "two_row_tiles_and_one": (33, 600, 512, True),  # 32-row blocks, then 16; K 600 -> 608
    "rows_past_a_work_item": (300, 96, 64, True),  # two 256-row items of a pair
    "many_column_pairs": (40, 576, 1536, True),  # items over both threads
    "short_k": (20, 7, 16, True),  # one K step, 25 zero pairs
    "kn_layout_ragged_columns": (19, 70, 37, False),  # [K, N], columns 32..36 by edge_tile
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tile_product_matches_float64_oracle(amx, case):
    fn, model = amx
    m, k, n, tiled = CASES[case]
    if not model and m < 16:
        pytest.skip("the hardware takes >= 16 rows (amx_min_rows); fewer stay on AVX-512")
    rng = np.random.default_rng(m + k + n)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    before = block_matmul_cpu.amx_calls(model=model)
    got = fn(x, block_matmul_cpu.pack_tiles(w) if tiled else w)
    assert block_matmul_cpu.amx_calls(model=model) == before + 1  # the tiles took it
    assert got.shape == (m, n) and got.dtype == jnp.float32
    x64, w64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    # float32 products of bf16 values (exact) summed in float32 over K pairs
    bound = 1e-6 * (np.abs(x64) @ np.abs(w64)) + 1e-6
    err = np.abs(np.asarray(got, np.float64) - x64 @ w64)
    assert (err <= bound).all(), err.max()


def test_bf16_output_is_the_float32_output_rounded(amx):
    """The tile product writing bf16 y (a bf16 model's Linear) rounds its float32 sums to
    nearest even, bit for bit; x goes in as bf16 rows (no float32 copy)."""
    fn, model = amx
    rng = np.random.default_rng(5)
    w = block_matmul_cpu.pack_tiles(jnp.asarray(rng.standard_normal((96, 80)), jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((33, 96)), jnp.bfloat16)
    before = block_matmul_cpu.amx_calls(model=model)
    got = fn(x, w, jnp.bfloat16)
    want = fn(x, w)
    assert block_matmul_cpu.amx_calls(model=model) == before + 2
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(got).view(np.uint16), np.asarray(want.astype(jnp.bfloat16)).view(np.uint16)
    )


def test_model_takes_only_what_the_tiles_compute():
    """float32 x, float32 weights: not the tile product (the other paths of the same kernel),
    and still correct."""
    _require("block_matmul_amx_model")
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((20, 64)), jnp.float32)
    before = block_matmul_cpu.amx_calls(model=True)
    got = block_matmul_cpu.dense_matmul_amx_model(x, block_matmul_cpu.pack_tiles(w))
    assert block_matmul_cpu.amx_calls(model=True) == before
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-4)


def test_model_equals_the_cpu_kernel_on_bf16():
    """The model and this CPU's path of the same product agree to float32 rounding."""
    _require("block_matmul_amx_model")
    _require("block_matmul")
    rng = np.random.default_rng(1)
    w = block_matmul_cpu.pack_tiles(jnp.asarray(rng.standard_normal((576, 96)), jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((24, 576)), jnp.bfloat16)
    np.testing.assert_allclose(
        np.asarray(block_matmul_cpu.dense_matmul_amx_model(x, w)),
        np.asarray(block_matmul_cpu.dense_matmul_cpu(x, w)),
        rtol=1e-4,
        atol=1e-4,
    )


def test_amx_build_compiles_for_sapphire_rapids():
    """The hardware path (amx::Hw) compiles where this CPU cannot run it: a build error in code
    only AMX machines take shows here, not on the first such machine."""
    try:
        native.compile_check("block_matmul", ("-march=sapphirerapids",))
    except RuntimeError as e:
        if "sapphirerapids" in str(e) and "bad value" in str(e):
            pytest.skip("this compiler does not know -march=sapphirerapids")
        raise
