"""paged_attention over a quantized cache (int8 / fp8_e4m3 pages + f16 per-token-head scales,
`kv_quant`): the shared test body of test_paged_attention, run against every implementation.

The inputs are test_paged_attention's (NaN everywhere the result must not depend on), quantized
row by row, so a NaN row becomes a NaN scale (and NaN fp8 values): the null page, unused pages,
slid-out slots and positions >= kv_len are poisoned in the scale pools too. Two checks each:
exactness against the float64 oracle run on the dequantized cache (what the kernel must compute),
and the quantization error against the oracle on the float cache (what a user gets)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import PagedAttentionConfig, kv_quant, paged_attention, pool_bits
from tests.pallas_kernels.test_paged_attention import CASES, IMPLS, build, oracle

KINDS = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}
# max |error| of attention outputs against the float cache per unit of q scale (unit-normal K/V;
# measured on eight cases: int8 0.014-0.024, fp8 0.073-0.107; q x3 gave 0.062 / 0.181)
QUANT_TOL = {"int8": 0.03, "fp8_e4m3": 0.13}
# ragged decode; holes + window; window + soft cap + sinks over a mixed batch; bf16 with all of
# them at d=128; a d=128 prefill (the float cases' full list runs in test_paged_attention)
NAMES = [
    "decode_ps16_g4",
    "window_small_holes_ps8",
    "all_f32_ps16_g4",
    "bf16_mixed_d128",
    "prefill_ps8_g1_d128",
]


def quantized_args(name: str, kind: str, *, bits: bool):
    """(float args, kwargs, quantized jnp args, scales kwargs, dequantized numpy K / V)."""
    args, kwargs = build(CASES[name])
    q, k, v, *rest = args
    dt = KINDS[kind]
    (kq, ks), (vq, vs) = (_poisoned(a, dt) for a in (k, v))
    deq = [np.asarray(kv_quant.dequantize(a, s)) for a, s in ((kq, ks), (vq, vs))]
    if bits:  # the reference backend's storage: fp8 as uint8 bits, f16 scales as uint16 bits
        kq, vq, ks, vs = (lax_bits(a) for a in (kq, vq, ks, vs))
    jargs = [jnp.asarray(q), kq, vq, *(jnp.asarray(a) for a in rest)]
    jkw = {key: (jnp.asarray(val) if isinstance(val, np.ndarray) else val) for key, val in kwargs.items()}
    return args, kwargs, jargs, {**jkw, "k_scales": ks, "v_scales": vs}, deq


def _poisoned(x: np.ndarray, dt) -> tuple[jax.Array, jax.Array]:
    """Quantized rows; the rows `build` made NaN (never to be read) get a NaN scale and garbage
    values (NaN for fp8, -128 for int8, outside the [-127, 127] a real row holds)."""
    dead = np.isnan(np.asarray(x, np.float32)).any(-1)
    vals, scales = kv_quant.quantize(jnp.asarray(np.nan_to_num(x), jnp.float32), dt)
    garbage = jnp.asarray(np.nan if jnp.dtype(dt) == kv_quant.FP8 else -128, dt)
    vals = jnp.where(jnp.asarray(dead)[..., None], garbage, vals)
    return vals, jnp.where(jnp.asarray(dead), jnp.asarray(np.nan, scales.dtype), scales)


def lax_bits(a: jax.Array) -> jax.Array:
    dt = pool_bits.storage_dtype(a.dtype)
    return a if dt == a.dtype else jax.lax.bitcast_convert_type(a, dt)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("name", NAMES)
def test_quantized_cache_matches_oracle(name: str, impl: str, kind: str) -> None:
    case = CASES[name]
    bits = impl.startswith(("reference", "cpu"))  # the CPU backends store bits (pool_bits)
    args, kwargs, jargs, jkw, (kd, vd) = quantized_args(name, kind, bits=bits)
    assert np.isnan(
        np.asarray(
            jkw["k_scales"] if not bits else jax.lax.bitcast_convert_type(jkw["k_scales"], jnp.float16),
            np.float32,
        )
    ).any(), "the scale pools carry NaN garbage"
    got = np.asarray(IMPLS[impl](*jargs, **jkw).astype(jnp.float32)).astype(np.float64)
    assert np.isfinite(got).all(), "NaN/inf leaked from pages or scales it must not read"
    n_real = int(args[5][len(case.q_lens)])
    assert np.all(got[n_real:] == 0.0), "padding tokens must be zeros"
    want = oracle(args[0], kd, vd, *args[3:], **kwargs)  # exactly the dequantized cache
    tol = 3e-2 if case.dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    err = np.max(np.abs(got - oracle(*args, **kwargs)))  # against the float cache
    assert err < QUANT_TOL[kind] * max(1.0, case.q_scale), err


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_quantized_kv_splits_and_tiling(kind: str) -> None:
    """Flash-decoding partials and another tiling read the scales the same way."""
    args, kwargs, jargs, jkw, (kd, vd) = quantized_args("all_f32_ps16_g4", kind, bits=False)
    want = oracle(args[0], kd, vd, *args[3:], **kwargs)
    for cfg in (
        PagedAttentionConfig(pages_per_block=2, block_q=4, kv_splits=4),
        PagedAttentionConfig(pages_per_block=1, block_q=16),
    ):
        got = paged_attention(*jargs, **jkw, interpret=True, config=cfg)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


BAD_SCALES = {
    "one_scale_pool": lambda kw: {**kw, "v_scales": None},
    "scale_shape": lambda kw: {**kw, "k_scales": kw["k_scales"][:, :, :1]},
    "scale_dtype": lambda kw: {**kw, "k_scales": kw["k_scales"].astype(jnp.float32)},
}


@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize("bad", sorted(BAD_SCALES) + ["float_pools_with_scales", "int_pools"])
def test_invalid_quantized_inputs_raise(impl: str, bad: str) -> None:
    args, kwargs, jargs, jkw, _ = quantized_args("decode_ps16_g4", "int8", bits=False)
    if bad in BAD_SCALES:
        jkw = BAD_SCALES[bad](jkw)
    elif bad == "float_pools_with_scales":
        jargs = [jargs[0], jnp.asarray(args[1]), jnp.asarray(args[2]), *jargs[3:]]
    else:  # int8 pools without scales
        jkw = {k: v for k, v in jkw.items() if k not in ("k_scales", "v_scales")}
    with pytest.raises(ValueError, match=r"=|must"):
        IMPLS[impl](*jargs, **jkw)


def test_quantize_round_trip_and_layout() -> None:
    x = jax.random.normal(jax.random.key(0), (7, 3, 64)) * 5
    for kind, dt in KINDS.items():
        vals, scales = kv_quant.quantize(x, dt)
        assert vals.dtype == dt and scales.dtype == kv_quant.SCALE_DTYPE and scales.shape == (7, 3)
        err = np.abs(np.asarray(kv_quant.dequantize(vals, scales) - x))
        amax = np.max(np.abs(np.asarray(x)), axis=-1, keepdims=True)
        # int8: half a step of amax / 127; fp8 e4m3: 3 mantissa bits, 2^-4 relative
        bound = amax / 127 * 0.51 if kind == "int8" else np.abs(np.asarray(x)) / 16 + amax / 448
        assert (err <= bound + 1e-6).all(), kind
    zeros, s = kv_quant.quantize(jnp.zeros((2, 8)), jnp.int8)
    assert not np.asarray(zeros).any() and np.isfinite(np.asarray(s, np.float32)).all()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.quantized_dtype("int4")
    # D int8 + an f16 scale per row vs 2D bytes in bf16: >= 1.9x the rows in the same memory
    for d in (64, 128):
        ratio = kv_quant.bytes_per_row("auto", "bfloat16", d) / kv_quant.bytes_per_row("int8", "bfloat16", d)
        assert ratio >= 1.9, (d, ratio)
    assert dataclasses.is_dataclass(CASES["decode_ps16_g4"])
