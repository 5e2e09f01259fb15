"""Top-k / top-p filtering: the staged `filtered_logits` (no sort / top candidates / full sort)
equals the full-sort reference on every row, whichever stage a step takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.runtime.filtering import filtered_logits, filtered_logits_reference

V = 1000
_fast = jax.jit(filtered_logits, static_argnames="candidates")
_ref = jax.jit(filtered_logits_reference)


def _logits(rows: int, scale: float, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (rows, V)) * scale


def _check(logits, temperature, top_k, top_p, candidates):
    args = (
        jnp.asarray(logits, jnp.float32),
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
    )
    got = np.asarray(_fast(*args, candidates=candidates))
    want = np.asarray(_ref(*args))
    filters = (np.asarray(top_k) > 0) & (np.asarray(top_k) < V) | (np.asarray(top_p) < 1)
    # rows asking for neither keep every token (the reference may drop a far tail by rounding)
    scaled = np.asarray(args[0]) / np.where(args[1] > 0, args[1], 1.0)[:, None]
    np.testing.assert_allclose(got[~filters], scaled[~filters], rtol=1e-6)
    np.testing.assert_array_equal(np.isfinite(got[filters]), np.isfinite(want[filters]))
    np.testing.assert_allclose(got[filters], want[filters], rtol=1e-6)
    return got


# (name, logits scale, temperature, top_k, top_p) per row; a scale of 8 makes a peaked row
# (top_p reached inside any candidate list), 0.1 a nearly flat one (top_p near 1 needs the sort)
CASES = {
    "temperature_only": (3.0, [1.0, 0.7, 0.0, 2.0], [-1, 0, -1, V], [1.0, 1.0, 1.0, 1.0]),
    "small_k_and_peaked_p": (8.0, [1.0, 1.0, 0.5, 1.0], [5, -1, 40, -1], [1.0, 0.9, 0.8, 1.0]),
    "k_past_candidates": (3.0, [1.0, 1.0, 1.0, 1.0], [600, -1, 3, -1], [1.0, 1.0, 0.5, 1.0]),
    "flat_with_p_near_one": (0.1, [1.0, 1.0, 1.0, 1.0], [-1, -1, 7, -1], [0.99, 0.5, 1.0, 1.0]),
    "k_and_p_together": (2.0, [1.0, 1.3, 0.8, 1.0], [50, 200, 10, 999], [0.6, 0.95, 0.3, 0.9]),
}


@pytest.mark.parametrize("candidates", [8, 256, V])
@pytest.mark.parametrize("case", sorted(CASES))
def test_staged_filtering_equals_the_full_sort(case, candidates):
    scale, temperature, top_k, top_p = CASES[case]
    got = _check(_logits(4, scale, seed=len(case)), temperature, top_k, top_p, candidates)
    kept = np.isfinite(got).sum(axis=-1)
    for row, k in enumerate(top_k):
        if 0 < k < V:
            assert 1 <= kept[row] <= k


def test_top_k_keeps_exactly_k_distinct_values():
    logits = _logits(3, 3.0, seed=7)
    got = _check(logits, [1.0] * 3, [1, 17, 256], [1.0] * 3, 256)
    np.testing.assert_array_equal(np.isfinite(got).sum(axis=-1), [1, 17, 256])


def test_ties_at_the_threshold_survive():
    row = np.full((V,), -5.0, np.float32)
    row[:3] = [4.0, 2.0, 2.0]  # top_k 2 cuts between two equal values: both stay
    got = _check(row[None], [1.0], [2], [1.0], 256)
    assert np.isfinite(got[0]).sum() == 3


def test_top_p_near_one_on_a_flat_row_falls_back_to_the_sort():
    # 256 of 1000 nearly equal tokens hold ~26% of the mass: the candidates cannot decide 0.9
    logits = _logits(2, 0.01, seed=3)
    got = _check(logits, [1.0, 1.0], [-1, -1], [0.9, 0.2], 256)
    kept = np.isfinite(got).sum(axis=-1)
    assert kept[0] > 256 and 150 < kept[1] < 256
