"""Kernel backends: the one switch between the paged implementations of attention and conv.

The implementations live in `pallas_kernels` and are checked by the shared kernel test bodies
(tests/pallas_kernels): "reference" = `paged_attention_reference` / `short_conv_reference`
(pure jnp; the runner hands them page tables cut to the step's kv bucket), "native" = the same
with decode tokens in a C++ XLA:CPU custom call (`paged_attention_cpu`; built on first use,
CPU only), "pallas" = the Pallas kernels (interpret mode off GPU), "auto" = pallas on GPU,
native on CPU (reference when no C++ compiler can build it). The model receives
the chosen functions as arguments (`CausalLM.__call__(attn_fn=, conv_fn=)`), so `models/` never
imports this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from pallas_kernels import (
    paged_attention,
    paged_attention_cpu,
    paged_attention_reference,
    pool_bits,
    short_conv,
    short_conv_reference,
)
from tokenspeed_jax.engine_args import ATTENTION_BACKENDS

__all__ = ["BACKENDS", "get_paged_attention", "get_short_conv", "jnp_layout", "pool_dtype", "resolve_backend"]

BACKENDS = ATTENTION_BACKENDS  # engine_args: one list of names


def resolve_backend(backend: str) -> str:
    """ "auto" -> "pallas" on GPU, "native" elsewhere; "native" -> "reference" (with the warning
    `pallas_kernels.native` logs) where its C++ kernel cannot be built; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    on_gpu = jax.default_backend() == "gpu"
    if backend == "auto":
        backend = "pallas" if on_gpu else "native"
    if backend == "native":
        if on_gpu:
            raise ValueError(
                "attention_backend='native' is the XLA:CPU kernel; on a GPU use 'auto' or 'pallas'"
            )
        return "native" if paged_attention_cpu.available() else "reference"
    return backend


def jnp_layout(backend: str) -> bool:
    """Whether resolved `backend` runs the jnp paths' layout: page tables cut to the step's kv
    bucket, bf16 / fp8 pools as their bits (`pool_bits`)."""
    return backend in ("reference", "native")


# One jit for every layer: the step's trace reuses the first layer's attention jaxpr and lowering
# (SmolLM2 trace + lower of a step: 3.4-3.6 -> 0.8-1.1 s; the same step speed measured).
_REFERENCE_JIT = jax.jit(
    paged_attention_reference,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "block_q", "max_gather_elems"),
)


_NATIVE_JIT = jax.jit(
    paged_attention_cpu.paged_attention_cpu,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "max_gather_elems"),
)


def get_paged_attention(backend: str) -> Callable:
    """The paged-attention function of `backend` (SPEC.md kernel signature)."""
    resolved = resolve_backend(backend)
    if resolved == "native":
        return _NATIVE_JIT
    if resolved == "reference":
        return _REFERENCE_JIT
    if jax.default_backend() != "gpu":
        return functools.partial(paged_attention, interpret=True)
    return paged_attention


def get_short_conv(backend: str) -> Callable:
    """The paged short conv of attention backend `backend`: the jnp reference, or the Pallas
    kernel (interpret mode off GPU); `pallas_kernels.short_conv` signature."""
    if jnp_layout(resolve_backend(backend)):
        return short_conv_reference
    return short_conv if jax.default_backend() == "gpu" else functools.partial(short_conv, interpret=True)


def pool_dtype(backend: str, dtype: str) -> str:
    """The storage dtype of the page pools of a `dtype` model under `backend`: the jnp reference
    keeps bf16 / f16 pools as their uint16 bits (XLA:CPU has no bf16 scatter and would copy
    every pool to float32 and back on each write; `pallas_kernels.pool_bits`), the Pallas
    kernels read float pools."""
    if jnp_layout(resolve_backend(backend)):
        return str(pool_bits.storage_dtype(dtype))
    return dtype


def devices_of(mesh: Mesh | None) -> list[Any]:
    """The devices a runner's step runs on: the mesh's, or the default device alone."""
    return jax.devices()[:1] if mesh is None else list(mesh.devices.flat)


def check_fp8_support(kv_cache_dtype: str, backend: str, mesh: Mesh | None) -> None:
    """fp8 pages on the Pallas GPU kernel need fp8 conversions in hardware (sm_89+: Ada,
    Hopper); on older GPUs Triton cannot compile the kernel, so say so up front."""
    if kv_cache_dtype != "fp8_e4m3" or backend != "pallas" or jax.default_backend() != "gpu":
        return
    for d in devices_of(mesh):
        cc = getattr(d, "compute_capability", None)
        if cc is not None and tuple(int(x) for x in str(cc).split(".")[:2]) < (8, 9):
            raise ValueError(
                f"kv_cache_dtype='fp8_e4m3' needs a GPU of compute capability >= "
                f"8.9 for the Pallas kernel; {d} has {cc} (use kv_cache_dtype="
                "'int8')"
            )
