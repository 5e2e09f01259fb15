"""Int8 weights: every `Linear` kernel (and a tied embedding table) kept as int8 with a float32
scale per output channel, chosen at load (`LLM(quantization=...)`).

Two ways to multiply by them, both dequantizing inside the jitted step (no full-precision copy
of a weight is ever held):
- "int8" (weight-only, W8A16): y = (x @ q) * s with q converted to x's dtype inside the dot;
  activations keep their precision, the only error is the weights' rounding.
- "w8a8" (int8 weights, dynamic int8 activations, as vLLM's CPU W8A8 / llama.cpp's Q8_0 dot): each
  token's activations are scaled by their absmax to int8, the dot runs int8 x int8 -> int32
  (exact), then y = acc * s_x * s. XLA:CPU runs that dot in its integer library path: 30 chained
  16 x 576 x 1536 matmuls take 8.3 ms against 52 ms in float32 and 35 ms in bf16 on this 2-core
  VM (benchmarks/quantization.py measures the model).
The MoE router stays in float (tiny, and its top-k decides which experts run).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

WEIGHT_QUANTIZATIONS = ("int8", "w8a8")
_QMAX = 127.0
_TINY = 1e-30


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {WEIGHT_QUANTIZATIONS}, got "
                         f"{quantization!r}")


def quantize_columns(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w f[in, out] -> (int8[in, out], f32[out]): symmetric per-output-channel absmax."""
    w32 = jnp.asarray(w, jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(w32), axis=0) / _QMAX, _TINY)
    q = jnp.clip(jnp.round(w32 / scale), -_QMAX, _QMAX).astype(jnp.int8)
    return q, scale


def qmatmul(x: jax.Array, q: jax.Array, scale: jax.Array, mode: str, *,
            q_transposed: bool = False) -> jax.Array:
    """x f[..., K] @ dequant(q int8[K, N] (q_transposed: [N, K]), scale f32[N]) in x's dtype."""
    dims = (((x.ndim - 1,), (1 if q_transposed else 0,)), ((), ()))
    if mode == "w8a8":
        x32 = x.astype(jnp.float32)
        sx = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / _QMAX, _TINY)
        xq = jnp.round(x32 / sx).astype(jnp.int8)
        acc = jax.lax.dot_general(xq, q, dims, preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * sx * scale
    else:
        y = jax.lax.dot_general(x, q.astype(x.dtype), dims,
                                preferred_element_type=jnp.float32) * scale
    return y.astype(x.dtype)


def quantize_model(model: Any, mode: str) -> int:
    """Quantize `model`'s Linear kernels in place (and a tied embedding table, by rows: a row
    is both an embedding and an output channel of the tied lm_head). Returns how many."""
    check_quantization(mode)
    n = 0
    for path, module in nnx.iter_graph(model):
        # A quantizable layer (models.layers.Linear) is known by its interface, not imported:
        # layers imports this module for qmatmul.
        quantizable = callable(getattr(module, "quantize", None)) and hasattr(module, "kernel_scale")
        if quantizable and "router" not in path and module.kernel_scale is None:
            module.quantize(mode)
            n += 1
    if getattr(model, "lm_head", False) is None and getattr(model, "embed_scale_q", None) is None:
        q, s = quantize_columns(model.embed_tokens.get_value().T)  # rows of [V, H]
        model.embed_tokens = nnx.Param(q.T)
        model.embed_scale_q = nnx.data(nnx.Param(s))  # was None: a static attribute
        model.quant_mode = mode
        n += 1
    return n
