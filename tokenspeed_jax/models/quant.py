"""Int8 weights: every `Linear` kernel (and a tied embedding table) kept as int8 with a float32
scale per output channel, chosen at load (`LLM(quantization=...)`). "q8_0" instead keeps each
Linear in llama.cpp's Q8_0 blocks (a scale per 32 inputs: `models/block_quant.py`), and "gguf"
keeps a .gguf file's own Q8_0 / Q4_0 / Q4_1 blocks (`hf/gguf.py`).

Two ways to multiply by them, both dequantizing inside the jitted step (no full-precision copy
of a weight is ever held):
- "int8" (weight-only, W8A16): activations keep their precision, the only error is the weights'
  rounding. Three lowerings of the same product, chosen per shape at trace time:
  - native (XLA:CPU when its C++ kernel builds): the block kernel of `models/block_quant.py`
    with one block of all K inputs; at every size for a tile-major q (`layers.Linear.tile`, the
    tied table's `tile_table`: one CPU device), else up to NATIVE_MAX_ROWS rows and not for a
    transposed table. 30 chained 576 x 1536 layers, tiled: 1 row 1.6 ms against split's 4.2,
    16 rows 6.8 against 16.1, 512 rows 187 against the float lowering's 214
    (benchmarks/block_matmul.py --kind int8);
  - split (XLA:CPU without the native kernel, up to SPLIT_MAX_ROWS rows): each token's
    activations are written exactly enough as two int8 rows, x = s1 * q1 + s2 * q2 with
    s2 = s1 / 254 (q2 holds the rounding residual of q1), and both go through one int8 x int8
    -> int32 dot: y = (acc1 * s1 + acc2 * s2) * s. The residual left is at most absmax / 64516
    per token, ~16 bits, below a bf16 activation's own rounding; XLA:CPU's integer dot reads the
    int8 weights directly, where the float lowering converted every weight matrix to float
    before its dot (the 0.35x of benchmarks/quantization.py before this). On 30 chained
    576 x 1536 layers: 1 row 9 ms against 59 in float32, 16 rows 22 against 76, 64 rows 57
    against 81; from 128 rows the doubled int8 dot loses (161 against 114). In the whole
    SmolLM2 step, whose ~4,000 small ops cost as much as its dots, all-padding steps of 1 / 16 /
    32 / 64 rows ran at 1.32x / 1.04x / 0.97x / 0.65x float32's speed: the split ends at 32.
  - float (prefill-sized steps, and every backend but CPU, whose compilers fuse the convert
    into the dot): y = (x @ q) * s with q converted to x's dtype inside the dot.
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

from pallas_kernels import block_matmul_cpu
from pallas_kernels.stacked import materialize
from tokenspeed_jax.engine_args import WEIGHT_QUANTIZATIONS
from tokenspeed_jax.models import cpu_dot

BLOCK_MODES = ("q8_0", "gguf")  # kernels held as blocks of 32 inputs (models/block_quant.py)
SPLIT_MAX_ROWS = 32  # split lowering of "int8" up to this many rows, on CPU (see above)
# The native block kernel (int8 and the block modes) up to this many rows: past it XLA's float
# dot of weights converted inside the step is as fast (benchmarks/block_matmul.py).
NATIVE_MAX_ROWS = 128
_QMAX = 127.0
_TINY = 1e-30


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {WEIGHT_QUANTIZATIONS}, got {quantization!r}")


def quantize_columns(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w f[in, out] -> (int8[in, out], f32[out]): symmetric per-output-channel absmax."""
    w32 = jnp.asarray(w, jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(w32), axis=0) / _QMAX, _TINY)
    q = jnp.clip(jnp.round(w32 / scale), -_QMAX, _QMAX).astype(jnp.int8)
    return q, scale


def use_native(rows: int | None = None) -> bool:
    """Whether a product of `rows` rows (any, when None) takes the native block kernel here
    (`pallas_kernels.block_matmul_cpu`); builds and registers it the first time (the runner calls
    this before loading cached executables that may call it)."""
    if jax.default_backend() != "cpu" or (rows is not None and rows > NATIVE_MAX_ROWS):
        return False
    return block_matmul_cpu.available()


def qmatmul(
    x: jax.Array, q: jax.Array, scale: jax.Array, mode: str, *, q_transposed: bool = False
) -> jax.Array:
    """x f[..., K] @ dequant(q int8[K, N] (q_transposed: [N, K]), scale f32[N]) in x's dtype."""
    dims = (((x.ndim - 1,), (1 if q_transposed else 0,)), ((), ()))
    native = mode != "w8a8" and (q.ndim == 3 or (not q_transposed and use_native(x.size // x.shape[-1])))
    if not native:  # scan_layers: only the native kernel reads a stacked weight in place
        q, scale = materialize(q), materialize(scale)
    if mode == "w8a8":
        x32 = x.astype(jnp.float32)
        sx = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / _QMAX, _TINY)
        xq = jnp.round(x32 / sx).astype(jnp.int8)
        acc = cpu_dot.dot(xq, q, dims[0][1][0], jnp.int32)  # a lone row as two (cpu_dot)
        y = acc.astype(jnp.float32) * sx * scale
    elif native:
        # tile-major q (`Linear.tile`): the native kernel at every size (30 chained 576 x 1536
        # layers: 1 row 3.5 ms, 1,024 rows 384 against the float lowering's 421)
        # one block of all K inputs: the per-channel scale is the block scale
        y = block_matmul_cpu.block_matmul_cpu(x, q, scale[None, :], out_dtype=x.dtype)
    elif x.size // x.shape[-1] <= SPLIT_MAX_ROWS and jax.default_backend() == "cpu":
        y = _split_int8_dot(x, q, dims) * scale
    else:
        y = jax.lax.dot_general(x, q.astype(x.dtype), dims, preferred_element_type=jnp.float32) * scale
    return y.astype(x.dtype)


def split_rows(x32: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x f32[R, K] -> (int8[2R, K], s1 f32[R, 1], s2 f32[R, 1]): x = s1 * top + s2 * bottom
    to within s2 / 2 = absmax / 64516 per token (the "split" lowering above)."""
    s1 = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / _QMAX, _TINY)
    q1 = jnp.round(x32 / s1)
    s2 = s1 / (2.0 * _QMAX)  # the residual is at most s1 / 2: it fills q2's range
    q2 = jnp.round((x32 - q1 * s1) / s2)
    return jnp.concatenate([q1, q2]).astype(jnp.int8), s1, s2


def _split_int8_dot(x: jax.Array, q: jax.Array, dims) -> jax.Array:
    """x f[..., K] . q int8 as two int8 rows per token (s1 * q1 + s2 * q2), f32[..., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x32 = x.astype(jnp.float32).reshape(-1, k)
    xq, s1, s2 = split_rows(x32)
    acc = jax.lax.dot_general(xq, q, (((1,), dims[0][1]), ((), ())), preferred_element_type=jnp.int32).astype(
        jnp.float32
    )
    rows = x32.shape[0]
    y = acc[:rows] * s1 + acc[rows:] * s2
    return y.reshape(*lead, -1)


def quantize_model(model: Any, mode: str) -> int:
    """Quantize `model`'s Linear kernels in place (and a tied embedding table, by rows: a row
    is both an embedding and an output channel of the tied lm_head). Returns how many."""
    check_quantization(mode)
    if mode == "gguf":  # the loader placed the blocks (hf/gguf.py); nothing to quantize here
        n = sum(getattr(m, "quant_mode", None) == "gguf" for _, m in nnx.iter_graph(model))
        if not n:
            raise ValueError(
                "quantization='gguf' keeps the Q8_0 / Q4_0 / Q4_1 blocks of a .gguf "
                "checkpoint: load a .gguf file that has some"
            )
        return n
    n = 0
    for path, module in nnx.iter_graph(model):
        # A quantizable layer (models.layers.Linear) is known by its interface, not imported:
        # layers imports this module for qmatmul.
        quantizable = callable(getattr(module, "quantize", None)) and hasattr(module, "kernel_scale")
        if quantizable and "router" not in path and module.kernel_scale is None:
            # an untied lm_head stays per channel under q8_0, like a tied table (below)
            module.quantize("int8" if mode in BLOCK_MODES and "lm_head" in path else mode)
            n += 1
    if getattr(model, "lm_head", False) is None and getattr(model, "embed_scale_q", None) is None:
        q, s = quantize_columns(model.embed_tokens.get_value().T)  # rows of [V, H]
        model.embed_tokens = nnx.Param(q.T)
        model.embed_scale_q = nnx.data(nnx.Param(s))  # was None: a static attribute
        # q8_0: the tied table's rows stay per-row int8 (its lm_head product over blocks would
        # materialize [K/32, T, vocab]), multiplied weight-only
        model.quant_mode = "int8" if mode in BLOCK_MODES else mode
        n += 1
    return n
