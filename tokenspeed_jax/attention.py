"""Attention backends: the switch between the two paged implementations, plus a dense oracle.

Both implementations live in `pallas_kernels` and are checked by the shared kernel test bodies
(tests/pallas_kernels): "reference" = `paged_attention_reference` (pure jnp; the runner hands it
page tables cut to the step's kv bucket), "pallas" = the Pallas kernel (interpret mode off GPU),
"auto" = pallas on GPU, reference elsewhere. The conv layers' choice is `models.conv.get_short_conv`.
`dense_attention` is the whole-sequence oracle of the model's `dense` forward (tests only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import paged_attention, paged_attention_reference

__all__ = ["BACKENDS", "dense_attention", "get_paged_attention", "resolve_backend"]

BACKENDS = ("auto", "pallas", "reference")


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


def resolve_backend(backend: str) -> str:
    """ "auto" -> "pallas" on GPU, "reference" elsewhere; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend


def get_paged_attention(backend: str) -> Callable:
    """The paged-attention function of `backend` (SPEC.md kernel signature)."""
    if resolve_backend(backend) == "reference":
        return paged_attention_reference
    if jax.default_backend() != "gpu":
        return functools.partial(paged_attention, interpret=True)
    return paged_attention
