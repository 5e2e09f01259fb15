"""The gated delta chunk kernel (Pallas, interpret mode on CPU) against the float64 sequential
oracle, in one test body shared with its jnp reference (`gated_delta_chunk.chunk_jnp`): cold and warm
states, strong decays, bf16 inputs, padded tokens, and several programs per head (block_v < Dv).
Then the chunked and packed drivers with `chunk_impl="pallas"` on lengths chunks do not divide,
and the input checks. The sm_90a compile of the kernel is in test_compile_sm90.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gated_delta as gd
from pallas_kernels.gated_delta_pallas import (
    GatedDeltaPallasConfig,
    gated_delta_chunk,
    gated_delta_chunk_reference,
    supported,
)
from tests.pallas_kernels.test_gated_delta import oracle

C, H, DK, DV = 16, 2, 16, 32
SMALL = GatedDeltaPallasConfig(block_v=16, num_warps=4)  # two programs per head

IMPLS = {
    "pallas": lambda *xs: gated_delta_chunk(*xs, interpret=True, config=SMALL),
    "reference": gated_delta_chunk_reference,
}


def sequence(rng: np.random.Generator, n: int, *, g_max: float = 2.0, beta_min: float = 0.05):
    """n tokens: q k [n, H, Dk] (normalized, q scaled as the model does), v [n, H, Dv], g beta
    [n, H] (decays down to -g_max)."""
    q = gd.l2norm(jnp.asarray(rng.normal(size=(n, H, DK)), jnp.float32)) * DK**-0.5
    k = gd.l2norm(jnp.asarray(rng.normal(size=(n, H, DK)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(n, H, DV)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, g_max, size=(n, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(beta_min, 1.0, size=(n, H)), jnp.float32)
    return q, k, v, g, beta


def chunk_inputs(seed: int, *, strong: bool = False, dtype=jnp.float32, warm: bool = True):
    """state f32[H, Dk, Dv] and one chunk of C tokens (`sequence`) in `dtype`."""
    rng = np.random.default_rng(seed)
    xs = sequence(rng, C, g_max=90.0 if strong else 2.0, beta_min=1e-3)
    state = jnp.asarray(rng.normal(size=(H, DK, DV)) if warm else np.zeros((H, DK, DV)), jnp.float32)
    return (state, *(x.astype(dtype) for x in xs))


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize(
    ("strong", "warm", "dtype", "tol"),
    [
        (False, False, jnp.float32, 2e-5),
        (False, True, jnp.float32, 2e-5),
        (True, True, jnp.float32, 2e-5),
        (False, True, jnp.bfloat16, 2e-2),  # the reference keeps bf16 products; the kernel f32
    ],
    ids=["cold", "warm", "strong_decays", "bf16"],
)
def test_chunk_matches_sequential_oracle(impl, strong, warm, dtype, tol):
    state, *xs = chunk_inputs(7, strong=strong, dtype=dtype, warm=warm)
    want_o, want_s = oracle(*xs, state)  # float64 on the (rounded) inputs
    o, s = IMPLS[impl](state, *xs)
    assert o.shape == (C, H, DV) and s.shape == (H, DK, DV)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    np.testing.assert_allclose(o, want_o, atol=tol, rtol=tol)
    np.testing.assert_allclose(s, want_s, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_padded_tokens_change_nothing(impl):
    """The drivers pad a last partial chunk with k = v = g = beta = 0: those tokens leave the state
    as the real ones left it, and the real tokens' outputs are those of the unpadded oracle."""
    state, q, k, v, g, beta = chunk_inputs(11)
    real = 9
    xs = [x.at[real:].set(0.0) for x in (q, k, v, g, beta)]
    o, s = IMPLS[impl](state, *xs)
    want_o, want_s = oracle(*(x[:real] for x in xs), state)
    np.testing.assert_allclose(o[:real], want_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(s, want_s, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n", [5, 37])
def test_chunked_driver_runs_the_kernel(n):
    """`gated_delta_chunked` with chunk_impl="pallas": a length the 16-token chunk does not divide,
    from a warm state, equals the oracle (and the jnp driver)."""
    rng = np.random.default_rng(n)
    q, k, v, g, beta = sequence(rng, n)
    state = jnp.asarray(rng.normal(size=(H, DK, DV)), jnp.float32)
    want_o, want_s = oracle(q, k, v, g, beta, state)
    for impl in ("pallas", "jnp"):
        o, s = gd.gated_delta_chunked(q, k, v, g, beta, state, gd.GatedDeltaConfig(16, impl))
        np.testing.assert_allclose(o, want_o, atol=2e-5, rtol=2e-5, err_msg=impl)
        np.testing.assert_allclose(s, want_s, atol=2e-5, rtol=2e-5, err_msg=impl)


def test_packed_driver_runs_the_kernel():
    """`gated_delta_packed` with chunk_impl="pallas" (jitted): a 20-token prefill row beside a
    decode row and a padding row; each row's state and outputs are the oracle's."""
    rng = np.random.default_rng(2)
    lens, t = [20, 1, 0], 32
    q, k, v, g, beta = sequence(rng, t)
    init = jnp.asarray(rng.normal(size=(len(lens), H, DK, DV)), jnp.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    packed = jax.jit(gd.gated_delta_packed, static_argnames="config")
    o, s, _ = packed(q, k, v, g, beta, init, jnp.asarray(cu), jnp.asarray([2], jnp.int32),
                     config=gd.GatedDeltaConfig(16, "pallas"))  # fmt: skip
    for row in range(len(lens)):
        a, b = cu[row], cu[row + 1]
        want_o, want_s = oracle(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], init[row])
        np.testing.assert_allclose(s[row], want_s, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(o[a:b], want_o, atol=2e-5, rtol=2e-5)


def test_impl_choice_and_shape_limits():
    """The default is "jnp" everywhere; "auto" takes the kernel only on a GPU and only for shapes it
    supports; "pallas" on unsupported shapes is a ValueError naming them."""
    assert gd.GatedDeltaConfig().chunk_impl == "jnp"
    assert gd._chunk_fn(gd.GatedDeltaConfig(), DK, DV) is gd._chunk
    if jax.default_backend() != "gpu":
        assert gd._chunk_fn(gd.GatedDeltaConfig(chunk_impl="auto"), DK, DV) is gd._chunk
    assert supported(64, 128, 128) and not supported(64, 8, 128) and not supported(48, 128, 128)
    state, q, k, v, g, beta = chunk_inputs(0)
    with pytest.raises(ValueError, match="powers of two"):
        gated_delta_chunk(state[:, :, :12], q, k, v[..., :12], g, beta, interpret=True)
    with pytest.raises(ValueError, match="q.shape"):
        gated_delta_chunk(state, q, k[:, :1], v, g, beta, interpret=True)
    with pytest.raises(ValueError, match="state.shape"):
        gated_delta_chunk(state.astype(jnp.bfloat16), q, k, v, g, beta, interpret=True)
    with pytest.raises(ValueError, match="chunk_impl"):
        gd.GatedDeltaConfig(chunk_impl="triton")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_v"):
        GatedDeltaPallasConfig(block_v=24)
