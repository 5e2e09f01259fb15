"""On-device sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

A row's random key is `fold_in(PRNGKey(seed), sample_index)`: it depends only on the request's
seed and how many tokens it has generated, so a seed reproduces the same tokens whatever else is
in the batch (and after retraction / resume). Logprobs come from the unmodified log-softmax of
the model's logits (before temperature / top-k / top-p), as vLLM reports them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["prompt_logprobs", "sample"]


def _filtered_logits(logits, temperature, top_k, top_p):
    """Temperature-scaled logits with everything outside top-k and then top-p set to -inf.

    One descending sort per row: top-k cuts the sorted list at k (<= 0 or >= V = all), top-p
    keeps the shortest prefix whose mass reaches top_p (the first token always survives), and the
    smallest surviving value becomes the row's threshold (ties at the threshold survive).
    """
    v = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / t[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k)
    rank = jnp.arange(v)[None, :]
    sorted_k = jnp.where(rank < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_k, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (rank < k[:, None]) & ((mass_before < top_p[:, None]) | (rank == 0))
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1)
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    sample_index: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row.

    logits f32[R, V]; temperature f32[R] (0 = greedy); top_k i32[R] (-1 = all); top_p f32[R] in
    (0, 1]; seeds u32[R]; sample_index i32[R] (tokens generated so far).
    Returns (tokens i32[R], logprobs f32[R] = log_softmax(logits)[token]).
    The sort-based filtering runs only on steps where some row samples (lax.cond), so all-greedy
    steps pay for an argmax alone.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic(_):
        filtered = _filtered_logits(logits, temperature, top_k, top_p)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(
            seeds.astype(jnp.uint32), sample_index.astype(jnp.int32)
        )
        drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda _: greedy, None)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def prompt_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log_softmax(logits[t])[targets[t]] per token; NaN where targets[t] < 0 (none / padding).

    logits f32[T, V]; targets i32[T]. Returns f32[T].
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(targets >= 0, picked, jnp.nan)
