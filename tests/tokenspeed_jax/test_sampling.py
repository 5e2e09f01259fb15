"""Sampling: greedy, filtering, per-request seeds independent of the batch, logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.runtime.draw import draw, row_keys
from tokenspeed_jax.runtime.sampling import prompt_logprobs, sample

V = 50
_sample = jax.jit(sample)


def _args(n, temperature=0.0, top_k=-1, top_p=1.0, seed=0, index=0):
    f = lambda x, dt: jnp.full((n,), x, dt)
    return (
        f(temperature, jnp.float32),
        f(top_k, jnp.int32),
        f(top_p, jnp.float32),
        f(seed, jnp.uint32),
        f(index, jnp.int32),
    )


def _logits(n, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (n, V)) * 3.0


def test_greedy_and_logprobs():
    logits = _logits(4)
    tok, lp = _sample(logits, *_args(4))
    np.testing.assert_array_equal(tok, np.argmax(logits, -1))
    want = np.asarray(jax.nn.log_softmax(logits))[np.arange(4), np.asarray(tok)]
    np.testing.assert_allclose(lp, want, rtol=1e-6)


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(6, 1)
    greedy = np.argmax(logits, -1)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        for s in range(5):
            tok, _ = _sample(logits, *_args(6, temperature=1.5, seed=s, **kw))
            np.testing.assert_array_equal(tok, greedy)


def test_top_k_and_top_p_support():
    row = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)))
    logits = jnp.tile(row[None], (300, 1))
    seeds = jnp.arange(300, dtype=jnp.uint32)
    temp, kt, kp, _, idx = _args(300, temperature=1.0)
    tk, _ = _sample(logits, temp, jnp.full((300,), 2, jnp.int32), kp, seeds, idx)
    tp, _ = _sample(logits, temp, kt, jnp.full((300,), 0.7, jnp.float32), seeds, idx)
    ta, _ = _sample(logits, temp, kt, kp, seeds, idx)
    assert set(np.asarray(tk).tolist()) == {0, 1}
    assert set(np.asarray(tp).tolist()) == {0, 1}  # 0.5 < 0.7 needs token 1; 0.8 >= 0.7 stops
    assert set(np.asarray(ta).tolist()) == {0, 1, 2, 3}


def test_seed_reproduces_whatever_the_batch():
    logits = _logits(8, 2)
    temp = jnp.array([1.0, 0.0, 2.0, 1.0, 1.0, 0.7, 1.0, 1.0], jnp.float32)
    seeds = jnp.arange(8, dtype=jnp.uint32) + 100
    idx = jnp.arange(8, dtype=jnp.int32)
    kt, kp = jnp.full((8,), -1, jnp.int32), jnp.ones((8,), jnp.float32)
    tok, _ = _sample(logits, temp, kt, kp, seeds, idx)
    # Row 3 alone, in another position of a different batch: same token.
    perm = jnp.array([5, 3, 0])
    tok2, _ = _sample(logits[perm], temp[perm], kt[:3], kp[:3], seeds[perm], idx[perm])
    np.testing.assert_array_equal(np.asarray(tok2), np.asarray(tok)[np.asarray(perm)])
    # A different sample_index or seed changes the draws (over many rows).
    many = jnp.tile(logits[:1] * 0, (64, 1))
    a, _ = _sample(many, *_args(64, temperature=1.0, seed=7))
    b, _ = _sample(many, *_args(64, temperature=1.0, seed=7, index=1))
    assert (np.asarray(a) != np.asarray(b)).any()
    assert len(set(np.asarray(a).tolist())) == 1  # same seed + index -> same draw on every row


def test_prompt_logprobs():
    logits = _logits(5, 3)
    targets = jnp.array([3, -1, 0, 49, -1], jnp.int32)
    out = np.asarray(jax.jit(prompt_logprobs)(logits, targets))
    logp = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(out[[0, 2, 3]], logp[[0, 2, 3], [3, 0, 49]], rtol=1e-6)
    assert np.isnan(out[[1, 4]]).all()


def test_draw_follows_the_distribution():
    """The inverse-CDF draw (`runtime.draw`): frequencies over 40,000 keys within 5 sigma of the
    softmax; -inf entries (here the first and the last, where a rounded-up u would land) never
    drawn."""
    logits = jnp.array([-jnp.inf, 1.0, 0.0, 2.5, -1.0, 0.5, -jnp.inf])
    n = 40_000
    keys = row_keys(jnp.arange(n, dtype=jnp.uint32) % 97, jnp.arange(n, dtype=jnp.int32))
    got = np.asarray(draw(keys, jnp.broadcast_to(logits, (n, logits.shape[0]))))
    p = np.asarray(jax.nn.softmax(logits))
    freq = np.bincount(got, minlength=p.size) / n
    assert freq[0] == 0 and freq[-1] == 0
    sigma = np.sqrt(p * (1 - p) / n)
    assert (np.abs(freq - p) <= 5 * sigma + 1e-9).all(), (freq, p)


def test_draw_one_finite_logit_and_a_large_vocabulary():
    keys = row_keys(jnp.array([1, 2, 3], jnp.uint32), jnp.array([0, 5, 9], jnp.int32))
    v = 49_152
    only = jnp.full((3, v), -jnp.inf).at[:, [0, 777, v - 1]].set(0.0)
    lone = np.asarray(draw(keys, only.at[0, 777].set(-jnp.inf).at[0, v - 1].set(-jnp.inf)))
    assert lone[0] == 0 and set(lone[1:].tolist()) <= {0, 777, v - 1}
