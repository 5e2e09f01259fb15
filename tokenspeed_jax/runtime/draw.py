"""One categorical draw per row, by inverse CDF: the sampler's and draft verification's draw.

`jax.random.categorical` adds Gumbel noise to every logit and takes the argmax: a threefry
number and two logarithms per vocabulary entry, 9.7 ms of a 16-row SmolLM2 decode step on a
2-core CPU (49,152 entries a row). The same distribution needs one uniform number per row:
token = the first index whose cumulative probability exceeds u * total. Both the sampler
(`sampling.sample`) and draft verification (`spec_verify.verify_drafts`) draw through here with
the same key, so a seeded request emits the same tokens with speculation as without.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["draw", "row_keys"]


def row_keys(seeds: jax.Array, sample_index: jax.Array) -> jax.Array:
    """The key of each row's output index: fold_in(PRNGKey(seed), sample_index).

    seeds u32[R]; sample_index i32[R]. Returns keys [R, 2] (u32)."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(
        seeds.astype(jnp.uint32), sample_index.astype(jnp.int32)
    )


def draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """A token per row drawn from softmax(logits); -inf logits are never drawn.

    keys [R, 2] u32 (`row_keys`); logits f32[R, V] with at least one finite value a row.
    Returns i32[R]."""
    logits = logits.astype(jnp.float32)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    cdf = jnp.cumsum(p, axis=-1)
    x = u * cdf[:, -1]
    # the first index whose cumulative mass exceeds x: its own mass is > 0
    idx = jnp.sum(cdf <= x[:, None], axis=-1)
    # u * total can round up to total: stay on the last token with mass
    v = logits.shape[-1]
    last = v - 1 - jnp.argmax(p[:, ::-1] > 0, axis=-1)
    return jnp.minimum(idx, last).astype(jnp.int32)
