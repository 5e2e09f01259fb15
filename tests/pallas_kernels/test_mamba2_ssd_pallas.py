"""The Mamba2 SSD chunk kernel (Pallas, interpret mode on CPU) against the float64 sequential
oracle, in one test body shared with its jnp reference (`mamba2_ssd_chunk.chunk_jnp`): cold and
warm states, strong decays, bf16 B / C, padded tokens, grouped B / C and two programs per head
(block_p < P). Then the chunked and packed drivers with `chunk_impl="pallas"` on lengths chunks do
not divide, and the input checks. The sm_90a compile of the kernel is in test_compile_sm90.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mamba2_ssd as ssd
from pallas_kernels.mamba2_ssd_pallas import SsdPallasConfig, ssd_chunk, ssd_chunk_reference, supported
from tests.pallas_kernels.test_mamba2_ssd import oracle

C, H, G, P, N = 16, 4, 2, 32, 16
SMALL = SsdPallasConfig(block_p=16)  # two programs per head

IMPLS = {
    "pallas": lambda *xs: ssd_chunk(*xs, interpret=True, config=SMALL),
    "reference": ssd_chunk_reference,
}


def sequence(rng: np.random.Generator, n: int, *, dt_max: float = 0.5):
    """n tokens: x [n, H, P], dt [n, H] in (0, dt_max], A [H] in [-16, -1], B C [n, G, N]."""
    x = jnp.asarray(rng.normal(size=(n, H, P)), jnp.float32)
    dt = jnp.asarray(rng.uniform(1e-3, dt_max, size=(n, H)), jnp.float32)
    A = -jnp.asarray(rng.uniform(1.0, 16.0, size=H), jnp.float32)
    B = jnp.asarray(rng.normal(size=(n, G, N)), jnp.float32)
    C_ = jnp.asarray(rng.normal(size=(n, G, N)), jnp.float32)
    return x, dt, A, B, C_


def chunk_inputs(seed: int, *, strong: bool = False, dtype=jnp.float32, warm: bool = True):
    """state f32[H, P, N] and one chunk of C tokens (`sequence`), B / C in `dtype`. Strong decays
    (dt up to 6, A to -16) give per-token log decays near -100."""
    rng = np.random.default_rng(seed)
    x, dt, A, B, C_ = sequence(rng, C, dt_max=6.0 if strong else 0.5)
    state = jnp.asarray(rng.normal(size=(H, P, N)) if warm else np.zeros((H, P, N)), jnp.float32)
    return state, x, dt, A, B.astype(dtype), C_.astype(dtype)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize(
    ("strong", "warm", "dtype", "tol"),
    [
        (False, False, jnp.float32, 2e-5),
        (False, True, jnp.float32, 2e-5),
        (True, True, jnp.float32, 2e-5),
        (False, True, jnp.bfloat16, 2e-5),  # both compute in f32 from the rounded B / C
    ],
    ids=["cold", "warm", "strong_decays", "bf16"],
)
def test_chunk_matches_sequential_oracle(impl, strong, warm, dtype, tol):
    state, *xs = chunk_inputs(7, strong=strong, dtype=dtype, warm=warm)
    want_y, want_s = oracle(*xs, state)  # float64 on the (rounded) inputs
    y, s = IMPLS[impl](state, *xs)
    assert y.shape == (C, H, P) and s.shape == (H, P, N)
    assert y.dtype == jnp.float32 and s.dtype == jnp.float32
    scale = max(1.0, float(np.abs(want_y).max()))
    np.testing.assert_allclose(y, want_y, atol=tol * scale, rtol=tol)
    np.testing.assert_allclose(s, want_s, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_padded_tokens_change_nothing(impl):
    """The drivers pad a last partial chunk with x = dt = B = C = 0: those tokens leave the state
    as the real ones left it, and the real tokens' outputs are those of the unpadded oracle."""
    state, x, dt, A, B, C_ = chunk_inputs(11)
    real = 9
    x, dt, B, C_ = (v.at[real:].set(0.0) for v in (x, dt, B, C_))
    y, s = IMPLS[impl](state, x, dt, A, B, C_)
    want_y, want_s = oracle(x[:real], dt[:real], A, B[:real], C_[:real], state)
    np.testing.assert_allclose(y[:real], want_y, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(s, want_s, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n", [5, 37])
def test_chunked_driver_runs_the_kernel(n):
    """`ssd_chunked` with chunk_impl="pallas": a length the 16-token chunk does not divide, from a
    warm state, equals the oracle (and the jnp driver)."""
    rng = np.random.default_rng(n)
    xs = sequence(rng, n)
    state = jnp.asarray(rng.normal(size=(H, P, N)), jnp.float32)
    want_y, want_s = oracle(*xs, state)
    for impl in ("pallas", "jnp"):
        y, s = ssd.ssd_chunked(*xs, state, ssd.Mamba2Config(16, impl))
        np.testing.assert_allclose(y, want_y, atol=2e-5, rtol=2e-5, err_msg=impl)
        np.testing.assert_allclose(s, want_s, atol=2e-5, rtol=2e-5, err_msg=impl)


def test_packed_driver_runs_the_kernel():
    """`ssd_packed` with chunk_impl="pallas" (jitted): a 20-token prefill row beside a decode row
    and a padding row; each row's state and outputs are the oracle's."""
    rng = np.random.default_rng(2)
    lens, t = [20, 1, 0], 32
    x, dt, A, B, C_ = sequence(rng, t)
    init = jnp.asarray(rng.normal(size=(len(lens), H, P, N)), jnp.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    packed = jax.jit(ssd.ssd_packed, static_argnames="config")
    y, s, _ = packed(x, dt, A, B, C_, init, jnp.asarray(cu), jnp.asarray([2], jnp.int32),
                     config=ssd.Mamba2Config(16, "pallas"))  # fmt: skip
    for row in range(len(lens)):
        a, b = cu[row], cu[row + 1]
        want_y, want_s = oracle(x[a:b], dt[a:b], A, B[a:b], C_[a:b], init[row])
        np.testing.assert_allclose(s[row], want_s, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(y[a:b], want_y, atol=2e-5, rtol=2e-5)


def test_impl_choice_and_shape_limits():
    """The default is "jnp" everywhere; "auto" takes the kernel only on a GPU and only for shapes it
    supports; bad shapes and configs are ValueErrors naming them."""
    assert ssd.Mamba2Config().chunk_impl == "jnp"
    assert ssd._chunk_fn(ssd.Mamba2Config(), P, N) is ssd._chunk
    if jax.default_backend() != "gpu":
        assert ssd._chunk_fn(ssd.Mamba2Config(chunk_impl="auto"), P, N) is ssd._chunk
    assert supported(64, 64, 128) and not supported(64, 8, 128) and not supported(48, 64, 128)
    state, x, dt, A, B, C_ = chunk_inputs(0)
    with pytest.raises(ValueError, match="powers of two"):
        ssd_chunk(state[:, :12], x[..., :12], dt, A, B, C_, interpret=True)
    with pytest.raises(ValueError, match="B.shape"):
        ssd_chunk(state, x, dt, A, B[:, :1], C_, interpret=True)
    with pytest.raises(ValueError, match="group count"):
        ssd_chunk(state, x[:, :3], dt[:, :3], A[:3], B, C_, interpret=True)
    with pytest.raises(ValueError, match="state.shape"):
        ssd_chunk(state.astype(jnp.bfloat16), x, dt, A, B, C_, interpret=True)
    with pytest.raises(ValueError, match="chunk_impl"):
        ssd.Mamba2Config(chunk_impl="triton")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_p"):
        SsdPallasConfig(block_p=24)
