"""Temperature, top-k and top-p filtering of logits (ordinary sampling and draft verification)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["filtered_logits"]


def filtered_logits(logits, temperature, top_k, top_p):
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
