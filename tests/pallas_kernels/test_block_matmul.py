"""The native block-quantized matmul (`pallas_kernels.block_matmul_cpu`) against a float64
oracle of the dequantized weights, with its reference run through the same body; shape errors
named; the lowering is one custom call with no dequantized weight matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_matmul_cpu
from pallas_kernels.block_matmul_cpu import TILE, block_matmul_reference
from pallas_kernels.stacked import LayerSlice
from tests.native_kernels import need_native

IMPLS = {"reference": block_matmul_reference, "native": block_matmul_cpu.block_matmul_cpu}
LAYOUTS = ("kn", "tiled")
# "native-stacked": the native kernel reading layer 1 of weights stacked over 3 layers in place
# (a LayerSlice, as scan_layers passes them)
IMPL_IDS = [f"{name}-{layout}" for name in sorted(IMPLS) for layout in LAYOUTS] + ["native-stacked"]


def _tiled(fn):
    """`fn` taking its weight [K, N] tile-major (`pack_tiles`). A weight of a dtype no kernel
    takes goes as it is (its ValueError is under test); one of N not a multiple of TILE is never
    generated here (`_with_impls`), so pack_tiles' own ValueError would fail the test."""

    def call(x, w, *rest):
        if w.dtype not in (jnp.int8, jnp.float32, jnp.bfloat16):
            return fn(x, w, *rest)
        return fn(x, block_matmul_cpu.pack_tiles(w), *rest)

    return call


def _stacked(fn):
    """`fn` taking its weight tile-major as layer 1 of a [3, ...] stack (its block scales and mins
    too), through `LayerSlice` under jit with the index traced: the kernel offsets its pointers
    into the stack (scan_layers). Layers 0 and 2 hold other values (NaN where a float can), so a
    wrong offset shows. Weights of a dtype no kernel takes go as they are (their ValueError)."""

    def other(a: jax.Array, fill: float) -> jax.Array:
        return jnp.full_like(a, 127 if a.dtype == jnp.int8 else fill)

    def call(x, w, *rest):
        if w.dtype not in (jnp.int8, jnp.float32, jnp.bfloat16):
            return fn(x, w, *rest)
        weights = [block_matmul_cpu.pack_tiles(w), *(r for r in rest if isinstance(r, jax.Array))]
        stacks = [jnp.stack([other(a, np.nan), a, other(a, -np.inf)]) for a in weights]
        tail = [r for r in rest if not isinstance(r, jax.Array)]

        def layer(i, x, *stacks):
            return fn(x, *(LayerSlice(s, i) for s in stacks), *tail)

        return jax.jit(layer)(jnp.int32(1), x, *stacks)

    return call


def _with_impls(cases, n_of) -> list:
    """(impl id, *case) for every implementation id and case, but tile-major ids only for cases
    whose weight has N (`n_of(case)`) a multiple of TILE: a tile-major weight of another N does
    not exist, so such a pair is not a test (it used to be generated and skipped)."""
    return [
        (ident, *(case if isinstance(case, tuple) else (case,)))
        for ident in IMPL_IDS
        for case in cases
        if ident.endswith("-kn") or n_of(case) % TILE == 0
    ]


def _impl(table, ident: str):
    name, layout = ident.split("-")
    if name == "native":
        need_native("block_matmul")  # fails in CI ($TOKENSPEED_JAX_REQUIRE_NATIVE) if unbuilt
    return {"kn": table[name], "tiled": _tiled(table[name]), "stacked": _stacked(table[name])}[layout]


@pytest.fixture
def impl(request):
    """The implementation named by the test's (indirect) parameter "<name>-<layout>"."""
    return _impl(IMPLS, request.param)


def _blocks(k: int, n: int, block: int, mins: bool, seed: int):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0 if mins else -128, 16 if mins else 128, (k, n)).astype(np.int8)
    scales = (rng.random((k // block, n)) * 0.02).astype(np.float32)
    m = (rng.standard_normal((k // block, n)) * 0.02).astype(np.float32) if mins else None
    return codes, scales, m


CASES = {  # (lead shape, K, N, block, mins)
    "decode_q8": ((1,), 64, 48, 32, False),
    "decode_q4_1": ((1,), 96, 32, 32, True),
    "rows_not_a_multiple_of_4": ((7,), 64, 32, 32, True),
    "cols_not_a_multiple_of_16": ((5,), 64, 37, 32, False),
    "lead_axes": ((2, 3), 128, 64, 32, True),
    "per_channel_block_is_k": ((9,), 64, 16, 64, False),
    "many_rows": ((70,), 64, 48, 32, True),
    # K past one L1 chunk of a tile (block_matmul.cc chunk_rows): whole blocks per chunk, or
    # the one per-channel block cut in two
    "k_chunks_q4_1": ((7,), 2048, 32, 32, True),
    "k_chunks_per_channel": ((7,), 1500, 16, 1500, False),
}


@pytest.mark.parametrize("impl,case", _with_impls(sorted(CASES), lambda c: CASES[c][2]), indirect=["impl"])
def test_matches_float64_oracle(impl, case):
    lead, k, n, block, mins = CASES[case]
    codes, scales, m = _blocks(k, n, block, mins, seed=len(case))
    x = np.random.default_rng(1).standard_normal((*lead, k)).astype(np.float32)
    w = codes.astype(np.float64).reshape(k // block, block, n) * scales[:, None, :]
    if m is not None:
        w = w + m[:, None, :]
    want = x.astype(np.float64) @ w.reshape(k, n)
    got = impl(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scales), None if m is None else jnp.asarray(m))
    assert got.shape == (*lead, n) and got.dtype == jnp.float32
    # float32 products summed over K: a few ulps of the sum of |terms|
    bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(w.reshape(k, n))) + 1e-6
    err = np.abs(np.asarray(got, np.float64) - want)
    assert (err <= bound).all(), err.max()


@pytest.mark.parametrize("impl", IMPL_IDS, indirect=True)
def test_bfloat16_activations(impl):
    codes, scales, m = _blocks(64, 32, 32, True, seed=3)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64)), jnp.bfloat16)
    got = impl(x, jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(m))
    want = block_matmul_reference(
        x.astype(jnp.float32), jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(m)
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# N = 16 (one tile): the tile-major layout takes every case too
@pytest.mark.parametrize("impl", IMPL_IDS, indirect=True)
@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(codes=np.zeros((64, 16), np.int32)), "codes must be int8"),
        (dict(x=np.zeros((2, 32), np.float32)), "last axis must be K"),
        (dict(scales=np.zeros((3, 16), np.float32)), "expected \\[K / B, N\\]"),
        (dict(scales=np.zeros((2, 4), np.float32)), "expected \\[K / B, N\\]"),
        (dict(mins=np.zeros((1, 16), np.float32)), "mins.shape"),
    ],
)
def test_invalid_inputs_raise(impl, bad, match):
    args = dict(
        x=np.zeros((2, 64), np.float32),
        codes=np.zeros((64, 16), np.int8),
        scales=np.zeros((2, 16), np.float32),
        mins=None,
    )
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        impl(*(None if v is None else jnp.asarray(v) for v in args.values()))


def test_lowers_to_one_custom_call_without_a_float_weight_copy():
    need_native("block_matmul")
    codes, scales, m = (jnp.asarray(a) for a in _blocks(576, 1536, 32, True, seed=0))
    hlo = (
        jax.jit(block_matmul_cpu.block_matmul_cpu)
        .lower(jnp.zeros((4, 576), jnp.float32), codes, scales, m)
        .compile()
        .as_text()
    )
    assert hlo.count('custom_call_target="tokenspeed_block_matmul"') == 1
    assert "f32[576,1536]" not in hlo


DENSE_IMPLS = {
    "reference": block_matmul_cpu.dense_matmul_reference,
    "native": block_matmul_cpu.dense_matmul_cpu,
}


@pytest.fixture
def dense_impl(request):
    """The dense implementation named by the test's (indirect) parameter "<name>-<layout>"."""
    return _impl(DENSE_IMPLS, request.param)


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "dense_impl,lead,k,n",
    _with_impls(
        [
            ((1,), 64, 48),
            ((7,), 96, 37),
            ((2, 3), 128, 64),
            ((70,), 64, 16),
            ((0,), 32, 16),
            ((7,), 600, 48),  # K in 3 (f32) / 2 (bf16) chunks
            ((25,), 600, 512),
        ],  # AVX-512: 12-row passes of tile pairs
        lambda c: c[2],
    ),
    indirect=["dense_impl"],
)
def test_dense_matches_float64_oracle(dense_impl, wdtype, lead, k, n):
    """Float weights through the same kernel (one block, scale 1): every row count's pass
    (6 rows, then 1-5 left over; with AVX-512, float32 tile pairs: 12 rows, then 1-11),
    columns past the last 16-wide tile, bf16 weights widened."""
    rng = np.random.default_rng(k + n)
    w = jnp.asarray(rng.standard_normal((k, n)), getattr(jnp, wdtype))
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    got = dense_impl(jnp.asarray(x), w)
    assert got.shape == (*lead, n) and got.dtype == jnp.float32
    bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(w64)) + 1e-6
    assert (np.abs(np.asarray(got, np.float64) - x.astype(np.float64) @ w64) <= bound).all()


@pytest.mark.parametrize(
    "dense_impl,lead,k,n",
    _with_impls(
        [((1,), 64, 512), ((25,), 600, 512), ((13,), 601, 512), ((3,), 7, 512), ((7,), 96, 48)],
        lambda c: c[2],
    ),
    indirect=["dense_impl"],
)
def test_dense_bf16_activations_match_float64_oracle(dense_impl, lead, k, n):
    """bf16 x and bf16 weights (a bf16 model's products): with AVX512-BF16 the tile pairs take
    the bf16 dot product (odd K: the last row paired with zeros), still float32 sums."""
    rng = np.random.default_rng(k + n)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((*lead, k)), jnp.bfloat16)
    x64, w64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    got = dense_impl(x, w)
    assert got.shape == (*lead, n) and got.dtype == jnp.float32
    bound = 1e-6 * (np.abs(x64) @ np.abs(w64)) + 1e-6
    assert (np.abs(np.asarray(got, np.float64) - x64 @ w64) <= bound).all()


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "dense_impl,lead,k,n",
    _with_impls([((1,), 64, 512), ((25,), 600, 512), ((7,), 96, 37)], lambda c: c[2]),
    indirect=["dense_impl"],
)
def test_dense_bf16_output_is_the_float32_output_rounded(dense_impl, wdtype, lead, k, n):
    """out_dtype=bf16 (what a bf16 model asks: no convert of XLA's after the product) is the
    float32 product rounded to nearest even, bit for bit, NaN rows included."""
    rng = np.random.default_rng(k + n)
    w = jnp.asarray(rng.standard_normal((k, n)), getattr(jnp, wdtype))
    x = np.asarray(rng.standard_normal((*lead, k)), np.float32)
    x[..., 0, 3] = np.nan  # a garbage row stays NaN, not inf
    x = jnp.asarray(x, jnp.bfloat16)
    want = dense_impl(x, w)
    got = dense_impl(x, w, jnp.bfloat16)
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    np.testing.assert_array_equal(
        np.asarray(got).view(np.uint16), np.asarray(want.astype(jnp.bfloat16)).view(np.uint16)
    )


# N = 16 (one tile): the tile-major layout takes every case too
@pytest.mark.parametrize("dense_impl", IMPL_IDS, indirect=True)
@pytest.mark.parametrize(
    "w,match",
    [
        (np.zeros((64, 16), np.float16), "float32 or bfloat16"),
        (np.zeros((32, 16), np.float32), "last axis must be K"),
    ],
)
def test_dense_invalid_inputs_raise(dense_impl, w, match):
    with pytest.raises(ValueError, match=match):
        dense_impl(jnp.zeros((2, 64), jnp.float32), jnp.asarray(w))


def test_pack_tiles_round_trip_and_layout():
    w = jnp.arange(32 * 48, dtype=jnp.int32).reshape(32, 48).astype(jnp.bfloat16)
    t = block_matmul_cpu.pack_tiles(w)
    assert t.shape == (3, 32, 16)
    # tile j holds columns [16 j, 16 j + 16) of every K row, K rows contiguous
    np.testing.assert_array_equal(np.asarray(t[1, 5]), np.asarray(w[5, 16:32]))
    np.testing.assert_array_equal(np.asarray(block_matmul_cpu.unpack_tiles(t)), np.asarray(w))
    assert block_matmul_cpu.weight_shape(t) == (32, 48) == block_matmul_cpu.weight_shape(w)
    with pytest.raises(ValueError, match="multiple of 16"):
        block_matmul_cpu.pack_tiles(jnp.zeros((32, 40), jnp.bfloat16))
    with pytest.raises(ValueError, match="tile-major"):
        block_matmul_cpu.unpack_tiles(jnp.zeros((2, 32, 8), jnp.bfloat16))


def test_tiled_codes_lower_to_one_custom_call_without_a_relayout():
    """Tile-major codes go to the kernel as they are: no transpose back to [K, N] in the step."""
    need_native("block_matmul")
    codes, scales, m = (jnp.asarray(a) for a in _blocks(576, 1536, 32, True, seed=0))
    hlo = (
        jax.jit(block_matmul_cpu.block_matmul_cpu)
        .lower(jnp.zeros((4, 576), jnp.float32), block_matmul_cpu.pack_tiles(codes), scales, m)
        .compile()
        .as_text()
    )
    assert hlo.count('custom_call_target="tokenspeed_block_matmul"') == 1
    assert "s8[576,1536]" not in hlo and "transpose" not in hlo
