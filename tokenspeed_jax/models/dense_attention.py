"""Plain causal (optionally sliding) attention of one whole sequence: the oracle of the model's
`dense` forward (tests, parity checks). The paged forward receives its kernel as an argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Plain causal (optionally sliding) attention of one whole sequence: the test oracle.

    q f[S, Hq, D]; k, v f[S, Hkv, D]; returns f[S, Hq, D].
    """
    s, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = d**-0.5 if sm_scale is None else sm_scale
    i = jnp.arange(s)[:, None]
    j = jnp.arange(s)[None, :]
    valid = j <= i
    if sliding_window is not None:
        valid = valid & (j > i - sliding_window)
    qg = q.reshape(s, hkv, g, d).astype(jnp.float32)
    scores = jnp.einsum("skgd,lkd->kgsl", qg, k.astype(jnp.float32)) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(valid, scores, -jnp.inf)  # the diagonal is always valid: no empty row
    if sinks is not None:  # a per-head sink logit joins the denominator only (GPT-OSS)
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(hkv, g, 1, 1), (hkv, g, s, 1))
        scores = jnp.concatenate([scores, sink], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)[..., :s]
    out = jnp.einsum("kgsl,lkd->skgd", probs, v.astype(jnp.float32))
    return out.reshape(s, hq, d).astype(q.dtype)
