"""Attention backends: the pure-jnp paged reference, a dense oracle, and the backend switch.

`paged_attention_jnp` has exactly the signature of `pallas_kernels.paged_attention` (SPEC.md), so
the runtime swaps one for the other behind `get_paged_attention(backend)`:
"reference" = this file (no dependency on pallas_kernels), "pallas" = the Pallas kernel
(interpret mode off GPU), "auto" = pallas on GPU, reference elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = [
    "BACKENDS",
    "dense_attention",
    "get_paged_attention",
    "get_short_conv",
    "paged_attention_jnp",
    "resolve_backend",
]

BACKENDS = ("auto", "pallas", "reference")
_NEG = -1e30  # finite "minus infinity": fully masked rows stay NaN-free


def _softmax_attend(scores, valid, sinks):
    """Attention weights: softmax over the last axis L of `scores` f32[..., Hkv, G, L].

    valid bool (broadcast to scores) masks keys; `sinks` (f32[Hkv, G] or broadcastable) adds a
    per-head sink logit to the denominator only (GPT-OSS). Masked entries get weight exactly 0
    (callers also zero masked values), so garbage or NaN in unread pages cannot leak out.
    """
    scores = jnp.where(valid, scores, _NEG)
    m = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks[..., None])
    p = jnp.where(valid, jnp.exp(scores - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks[..., None] - m)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return p


def paged_attention_jnp(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    interpret: bool = False,
    token_block: int = 64,
) -> jax.Array:
    """Ragged paged attention, pure jnp (reference backend). Same contract as SPEC.md's kernel.

    q f[T, Hq, D] packed query tokens; k_pages, v_pages f[P, B, Hkv, D]; page_table i32[S, Wp]
    (0 = hole); kv_lens i32[S] tokens in cache incl. this step's; cu_q_lens i32[S+1];
    num_seqs i32[1]. The query tokens of sequence s sit at the last q_len positions of kv_len.
    Sliding windows gather only the ceil((W-1)/B)+1 pages that can hold the window (holes before
    it are never read). Tokens past cu_q_lens[num_seqs] (padding) return 0. Returns f[T, Hq, D].
    `interpret` is accepted for signature compatibility and ignored.
    """
    del interpret
    t_total, hq, d = q.shape
    _, b, hkv, _ = k_pages.shape
    s_rows, wp = page_table.shape
    g = hq // hkv
    scale = d**-0.5 if sm_scale is None else sm_scale
    n_pages = wp if sliding_window is None else min(wp, -(-(sliding_window - 1) // b) + 1)

    t = jnp.arange(t_total, dtype=jnp.int32)
    row = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid_tok = t < cu_q_lens[num_seqs[0]]
    row = jnp.clip(row, 0, s_rows - 1)
    pos = kv_lens[row] - (cu_q_lens[row + 1] - t)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(hkv, g)

    def one_token(args):
        qt, r, p, ok = args  # qt [Hq, D]
        first = 0 if sliding_window is None else jnp.maximum(p - sliding_window + 1, 0) // b
        cols = first + jnp.arange(n_pages, dtype=jnp.int32)
        pages = page_table[r, jnp.minimum(cols, wp - 1)]  # [n_pages]
        kpos = (cols[:, None] * b + jnp.arange(b)[None, :]).reshape(-1)  # [L]
        valid = ok & (kpos <= p) & jnp.repeat(cols < wp, b)
        if sliding_window is not None:
            valid = valid & (kpos > p - sliding_window)
        k = k_pages[pages].reshape(-1, hkv, d)  # [L, Hkv, D]
        v = v_pages[pages].reshape(-1, hkv, d)
        v = jnp.where(valid[:, None, None], v, 0).astype(jnp.float32)
        qg = qt.reshape(hkv, g, d).astype(jnp.float32)
        scores = jnp.einsum("kgd,lkd->kgl", qg, k.astype(jnp.float32)) * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        probs = _softmax_attend(scores, valid, sink)
        out = jnp.einsum("kgl,lkd->kgd", probs, v).reshape(hq, d)
        return jnp.where(ok, out, 0.0).astype(q.dtype)

    return jax.lax.map(one_token, (q, row, pos, valid_tok), batch_size=token_block)


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
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(hkv, g, 1)
    probs = _softmax_attend(scores, valid, sink)
    out = jnp.einsum("kgsl,lkd->skgd", probs, v.astype(jnp.float32))
    return out.reshape(s, hq, d).astype(q.dtype)


def resolve_backend(backend: str) -> str:
    """ "auto" -> "pallas" on GPU, "reference" elsewhere; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" and _pallas_kernel() else "reference"
    return backend


def _pallas_kernel() -> Callable | None:
    try:
        from pallas_kernels import paged_attention
    except ImportError:
        return None
    return paged_attention


def get_short_conv(backend: str) -> Callable | None:
    """The paged short-conv function of `backend`; None = the model's built-in jnp taps."""
    if resolve_backend(backend) == "reference":
        return None
    try:
        from pallas_kernels import short_conv
    except ImportError as e:
        raise ValueError("attention_backend='pallas' but pallas_kernels.short_conv is missing") from e
    if jax.default_backend() != "gpu":
        return functools.partial(short_conv, interpret=True)
    return short_conv


def get_paged_attention(backend: str) -> Callable:
    """The paged-attention function of `backend` (SPEC.md kernel signature)."""
    backend = resolve_backend(backend)
    if backend == "reference":
        return paged_attention_jnp
    kernel = _pallas_kernel()
    if kernel is None:
        raise ValueError("attention_backend='pallas' but pallas_kernels.paged_attention is missing")
    if jax.default_backend() != "gpu":
        return functools.partial(kernel, interpret=True)
    return kernel
