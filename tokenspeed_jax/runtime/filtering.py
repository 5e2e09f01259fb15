"""Temperature, top-k and top-p filtering of logits (ordinary sampling and draft verification).

What it costs decides served throughput on a CPU: a full descending sort of [16, 49152] f32
logits takes ~210 ms on a 2-core AVX2 VM, longer than the whole SmolLM2 decode step it rides
on (~180 ms). So the work is staged, each stage only on the steps that need it (`lax.cond`):
  1. no row asks for top-k or top-p (temperature alone: the OpenAI default) -> the scaled
     logits as they are, no sort at all;
  2. otherwise the `CANDIDATES` largest values of each row (`lax.top_k`, ~5 ms) decide the
     threshold whenever they provably hold every token the full sort would keep: k <= CANDIDATES,
     or no top-k and the candidates' probability mass already reaches top_p;
  3. otherwise (a large k, or a flat distribution with top_p near 1) the full sort.
Stages 2 and 3 give the same threshold (`filtered_logits_reference` is stage 3 on every row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["CANDIDATES", "filtered_logits", "filtered_logits_reference"]

CANDIDATES = 256  # per-row largest logits stage 2 looks at (lax.top_k on CPU: ~5 ms at 16 rows)


def _effective_k(top_k: jax.Array, v: int) -> jax.Array:
    """top-k with "off" (<= 0 or >= V) spelled as V."""
    return jnp.where((top_k <= 0) | (top_k >= v), v, top_k)


def _threshold(
    sorted_desc: jax.Array, k: jax.Array, top_p: jax.Array, full_norm: jax.Array | None = None
) -> jax.Array:
    """The smallest kept value of each row, given its largest values in descending order
    f32[R, C] (C = V for a full sort): top-k cuts the list at k, top-p keeps the shortest prefix
    whose mass reaches top_p (the first value always survives). The mass is a softmax over the
    first k values; full_norm f32[R] (only when C < V): the log-denominator over the whole row,
    used by the rows whose k (= V) reaches past the list."""
    c = sorted_desc.shape[-1]
    rank = jnp.arange(c)[None, :]
    in_k = rank < k[:, None]
    sorted_k = jnp.where(in_k, sorted_desc, -jnp.inf)
    norm = jax.nn.logsumexp(sorted_k, axis=-1)
    if full_norm is not None:
        norm = jnp.where(k > c, full_norm, norm)
    probs = jnp.exp(sorted_k - norm[:, None])
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & ((mass_before < top_p[:, None]) | (rank == 0))
    return jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1)


def filtered_logits_reference(logits, temperature, top_k, top_p):
    """Temperature-scaled logits with everything outside top-k and then top-p set to -inf, by
    one full descending sort per row (ties at the threshold survive). logits f32[R, V];
    temperature f32[R] (<= 0 counts as 1: greedy rows take the argmax elsewhere); top_k i32[R]
    (<= 0 or >= V = all); top_p f32[R] in (0, 1]."""
    v = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    threshold = _threshold(sorted_desc, _effective_k(top_k, v), top_p)
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def filtered_logits(logits, temperature, top_k, top_p, *, candidates: int = CANDIDATES):
    """`filtered_logits_reference`'s result, sorting only when it must (module docstring).
    Rows that ask for neither top-k nor top-p keep every token. Same shapes as the reference;
    `candidates` is static (one compile)."""
    v = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    k = _effective_k(top_k, v)
    filters = (k < v) | (top_p < 1.0)

    def full_sort(x):
        return _threshold(-jnp.sort(-x, axis=-1), k, top_p)

    def by_threshold(x):
        if candidates >= v:
            threshold = full_sort(x)
        else:
            top = jax.lax.top_k(x, candidates)[0]
            # the whole row's softmax denominator: exact for rows without top-k (k = V)
            log_norm = jax.nn.logsumexp(x, axis=-1)
            probs = jnp.exp(top - log_norm[:, None])
            covered = (k <= candidates) | ((k == v) & (jnp.sum(probs, axis=-1) >= top_p))
            threshold = jax.lax.cond(
                jnp.all(covered | ~filters),
                lambda t: _threshold(t, k, top_p, log_norm),
                lambda _: full_sort(x),
                top,
            )
        threshold = jnp.where(filters, threshold, -jnp.inf)
        return jnp.where(x >= threshold[:, None], x, -jnp.inf)

    return jax.lax.cond(jnp.any(filters), by_threshold, lambda x: x, scaled)
