"""The gated delta rule's three jnp forms against a sequential float64 numpy oracle: the chunked
form on lengths that chunks do not divide, from zero and non-zero states; the packed (ragged)
form on mixed steps of decode rows, prefill rows and padding; and a float32 step's state is
what the oracle's is."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import (
    GatedDeltaConfig,
    gated_delta_chunked,
    gated_delta_packed,
    gated_delta_reference,
    l2norm,
)

H, DK, DV = 3, 8, 6
TOL = 2e-4


def oracle(q, k, v, g, beta, state=None):
    """Token-by-token float64 recurrence: (o [S, H, Dv], final state [H, Dk, Dv])."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    s = np.zeros((q.shape[1], q.shape[2], v.shape[2])) if state is None else np.asarray(state, np.float64)
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        s = s * np.exp(g[t])[:, None, None]
        kv_mem = np.einsum("hkv,hk->hv", s, k[t])
        s = s + k[t][:, :, None] * ((v[t] - kv_mem) * beta[t][:, None])[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def inputs(rng, n):
    """Normalized q / k (q scaled as the model does), decays spanning slow to fast."""
    q = l2norm(jnp.asarray(rng.normal(size=(n, H, DK)), jnp.float32)) * DK**-0.5
    k = l2norm(jnp.asarray(rng.normal(size=(n, H, DK)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(n, H, DV)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 2.0, size=(n, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.05, 1.0, size=(n, H)), jnp.float32)
    return q, k, v, g, beta


def test_chunked_keeps_relative_accuracy_under_strong_decays():
    """Trained Qwen3.5 gates reach g = -90 per token, so a 64-token chunk's decays sum to
    thousands; the pairwise decays must be summed directly, not as cum_i - cum_j (that loses
    ~1e-4 of every decay, which the gated RMSNorm then amplifies on small outputs)."""
    rng = np.random.default_rng(5)
    q, k, v, _, _ = inputs(rng, 64)
    g = -jnp.asarray(rng.uniform(0.0, 90.0, size=(64, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(1e-3, 1.0, size=(64, H)), jnp.float32)
    want_o, want_s = oracle(q, k, v, g, beta)
    o, s = gated_delta_chunked(q, k, v, g, beta, None, GatedDeltaConfig(64))
    rel = np.linalg.norm(np.asarray(o) - want_o, axis=-1) / np.linalg.norm(want_o, axis=-1)
    assert rel.max() < 1e-5, f"per-token relative error {rel.max():.1e}"
    np.testing.assert_allclose(s, want_s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 5, 16, 37])
@pytest.mark.parametrize("chunk", [4, 16, 64])
@pytest.mark.parametrize("warm", [False, True])
def test_chunked_matches_sequential_oracle(n, chunk, warm):
    rng = np.random.default_rng(n * 100 + chunk)
    xs = inputs(rng, n)
    state = jnp.asarray(rng.normal(size=(H, DK, DV)), jnp.float32) if warm else None
    want_o, want_s = oracle(*xs, state)
    for fn in (lambda: gated_delta_chunked(*xs, state, GatedDeltaConfig(chunk)),
               lambda: gated_delta_reference(*xs, state)):  # fmt: skip
        o, s = fn()
        np.testing.assert_allclose(o, want_o, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(s, want_s, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("chunk", [4, 64])
def test_packed_rows_match_each_alone(chunk):
    """Rows of 1 (decode), 7, 1, 13 tokens and two padding rows in a 32-token bucket: each row's
    outputs and final state equal the oracle run on that row alone from its own state; padding
    rows keep theirs; padded tokens give 0."""
    rng = np.random.default_rng(chunk)
    lens = [1, 7, 1, 13, 0, 0]
    t, r = 32, len(lens)
    xs = inputs(rng, t)
    init = jnp.asarray(rng.normal(size=(r, H, DK, DV)), jnp.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    jitted = jax.jit(gated_delta_packed, static_argnames="config")
    o, s, _ = jitted(*xs, init, jnp.asarray(cu), jnp.asarray([4], jnp.int32), config=GatedDeltaConfig(chunk))
    for row in range(len(lens)):
        a, b = cu[row], cu[row + 1]
        want_o, want_s = oracle(*(x[a:b] for x in xs), init[row])
        np.testing.assert_allclose(s[row], want_s, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(o[a:b], want_o, atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(o[cu[-1] :], 0.0)


def test_packed_nan_inputs_of_padding_do_not_leak():
    """Garbage in padded token slots (past the last row) never reaches a row's output or state."""
    rng = np.random.default_rng(3)
    xs = list(inputs(rng, 16))
    xs = [x.at[9:].set(jnp.nan) for x in xs]
    init = jnp.zeros((3, H, DK, DV), jnp.float32)
    cu = jnp.asarray([0, 1, 9, 9], jnp.int32)
    o, s, _ = gated_delta_packed(*xs, init, cu, jnp.asarray([2], jnp.int32), GatedDeltaConfig(4))
    assert np.isfinite(np.asarray(o[:9])).all() and np.isfinite(np.asarray(s)).all()
    want_o, want_s = oracle(*(x[1:9] for x in xs), init[1])
    np.testing.assert_allclose(s[1], want_s, atol=TOL, rtol=TOL)


def test_bad_shapes_are_value_errors():
    q, k, v, g, beta = inputs(np.random.default_rng(0), 4)
    with pytest.raises(ValueError, match="q.shape"):
        gated_delta_chunked(q, k[:, :2], v, g, beta)
    with pytest.raises(ValueError, match="initial_states.shape"):
        gated_delta_packed(q, k, v, g, beta, jnp.zeros((2, H, DK, DK)), jnp.zeros(3, jnp.int32),
                           jnp.ones(1, jnp.int32))  # fmt: skip
    with pytest.raises(ValueError, match="chunk_size"):
        GatedDeltaConfig(0)


def test_lowers_without_lapack_calls():
    """The chunk's triangular inverse is matmuls only: a LAPACK custom call's CPU kernel is bound
    when JAX lowers it, so an executable read back from the executable cache in a fresh process
    called through a null pointer (a segfault in serving, found by benchmarks/hybrid.py)."""
    xs = inputs(np.random.default_rng(0), 8)
    text = (
        jax.jit(gated_delta_chunked, static_argnames="config")
        .lower(*xs, None, config=GatedDeltaConfig(4))
        .as_text()
    )
    assert "lapack" not in text.lower() and "trsm" not in text.lower()
