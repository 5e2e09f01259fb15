"""Page snapshots of the ragged driver (`pallas_kernels.ragged_scan`), one body run against both
recurrences: rows whose chunks are aligned to page boundaries (`align`) leave, in a pool full of
NaN garbage, the float64 oracle's state after every page-end token; outputs and final states
are unchanged by the alignment; pages of no token stay untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import GatedDeltaConfig, gated_delta_packed
from pallas_kernels.mamba2_ssd import Mamba2Config, ssd_packed
from tests.pallas_kernels import test_gated_delta as gd
from tests.pallas_kernels import test_mamba2_ssd as ssd

# name -> (inputs(rng, n), oracle(*inputs, state), packed(*inputs, states, cu, num_seqs, config,
# align, snapshots), config of chunk c, state shape, per-token flags of the inputs)
IMPLS = {
    "gated_delta": (gd.inputs, gd.oracle, gated_delta_packed, GatedDeltaConfig, (gd.H, gd.DK, gd.DV),
                    (True,) * 5),
    "mamba2": (ssd.inputs, ssd.oracle, ssd_packed, Mamba2Config, (ssd.H, ssd.P, ssd.N),
               (True, True, False, True, True)),
}  # fmt: skip
PAGE, CHUNK = 8, 4  # the chunk divides the page, as the models choose it


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_page_end_snapshots_match_the_oracle(impl):
    make_inputs, oracle, packed, config, state_shape, per_token = IMPLS[impl]
    rng = np.random.default_rng(4)
    lens, firsts = [1, 11, 17, 1], [7, 3, 0, 14]  # tokens this step, position of each row's first
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = 40  # bucket: padding after cu[-1] = 30
    xs = make_inputs(rng, t)
    init = rng.normal(size=(4, *state_shape)).astype(np.float32)
    init[2] = 0.0  # a fresh prompt
    pos = np.zeros(t, np.int64)
    for r, (n, f) in enumerate(zip(lens, firsts, strict=True)):
        pos[cu[r] : cu[r + 1]] = f + np.arange(n)
    num_pages = 32
    page_of = np.full(t, num_pages, np.int32)  # a distinct page per page-end token
    ends = [i for i in range(cu[-1]) if (pos[i] + 1) % PAGE == 0]
    page_of[ends] = 1 + np.arange(len(ends))
    pool = jnp.full((num_pages, *state_shape), jnp.nan, jnp.float32)
    align = jnp.asarray(np.asarray(firsts) % CHUNK, jnp.int32)
    run = jax.jit(packed, static_argnames="config")
    args = (*xs, jnp.asarray(init), jnp.asarray(cu), jnp.asarray([4], jnp.int32))
    snaps = (pool, jnp.asarray(page_of))
    out, states, pool = run(*args, config=config(CHUNK), align=align, snapshots=snaps)
    plain, plain_states, _ = run(*args, config=config(CHUNK))
    np.testing.assert_allclose(out, plain, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(states, plain_states, atol=1e-5, rtol=1e-5)
    pool = np.asarray(pool)
    for r in range(4):
        sl = slice(cu[r], cu[r + 1])
        row = [x[sl] if tok else x for x, tok in zip(xs, per_token, strict=True)]
        want_o, want_s = oracle(*row, init[r])
        np.testing.assert_allclose(out[sl], want_o, atol=gd.TOL, rtol=gd.TOL)
        np.testing.assert_allclose(states[r], want_s, atol=gd.TOL, rtol=gd.TOL)
        for i in range(cu[r], cu[r + 1]):
            if page_of[i] < num_pages:  # the oracle's state after token i
                prefix = [x[cu[r] : i + 1] if tok else x for x, tok in zip(xs, per_token, strict=True)]
                np.testing.assert_allclose(
                    pool[page_of[i]], oracle(*prefix, init[r])[1], atol=gd.TOL, rtol=gd.TOL
                )
    assert np.isnan(pool[len(ends) + 1 :]).all() and np.isnan(pool[0]).all()  # nothing else written
    assert len(ends) == 4  # page ends: row 0's decode token (7), row 1 (7), row 2 (7, 15)
