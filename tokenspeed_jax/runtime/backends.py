"""Kernel backends: the one switch between the paged implementations of attention and conv.

Both implementations of each live in `pallas_kernels` and are checked by the shared kernel test
bodies (tests/pallas_kernels): "reference" = `paged_attention_reference` / `short_conv_reference`
(pure jnp; the runner hands them page tables cut to the step's kv bucket), "pallas" = the Pallas
kernels (interpret mode off GPU), "auto" = pallas on GPU, reference elsewhere. The model receives
the chosen functions as arguments (`CausalLM.__call__(attn_fn=, conv_fn=)`), so `models/` never
imports this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    pool_bits,
    short_conv,
    short_conv_reference,
)

__all__ = ["BACKENDS", "get_paged_attention", "get_short_conv", "pool_dtype", "resolve_backend"]

BACKENDS = ("auto", "pallas", "reference")


def resolve_backend(backend: str) -> str:
    """ "auto" -> "pallas" on GPU, "reference" elsewhere; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend


# One jit for every layer: the step's trace reuses the first layer's attention jaxpr and lowering
# (SmolLM2 trace + lower of a step: 3.4-3.6 -> 0.8-1.1 s; the same step speed measured).
_REFERENCE_JIT = jax.jit(paged_attention_reference, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "block_q", "max_gather_elems"))


def get_paged_attention(backend: str) -> Callable:
    """The paged-attention function of `backend` (SPEC.md kernel signature)."""
    if resolve_backend(backend) == "reference":
        return _REFERENCE_JIT
    if jax.default_backend() != "gpu":
        return functools.partial(paged_attention, interpret=True)
    return paged_attention


def get_short_conv(backend: str) -> Callable:
    """The paged short conv of attention backend `backend`: the jnp reference, or the Pallas
    kernel (interpret mode off GPU); `pallas_kernels.short_conv` signature."""
    if resolve_backend(backend) == "reference":
        return short_conv_reference
    return short_conv if jax.default_backend() == "gpu" else functools.partial(short_conv, interpret=True)


def pool_dtype(backend: str, dtype: str) -> str:
    """The storage dtype of the page pools of a `dtype` model under `backend`: the jnp reference
    keeps bf16 / f16 pools as their uint16 bits (XLA:CPU has no bf16 scatter and would copy
    every pool to float32 and back on each write; `pallas_kernels.pool_bits`), the Pallas
    kernels read float pools."""
    if resolve_backend(backend) == "reference":
        return str(pool_bits.storage_dtype(dtype))
    return dtype
