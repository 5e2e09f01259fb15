"""Small building blocks with Hugging Face style parameter names: Linear, RMSNorm, RoPE, MLP.

Weights are stored `[in, out]` (JAX convention); an HF loader transposes `weight` `[out, in]`.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.block_matmul_cpu import dense_matmul_cpu, pack_tiles, tileable
from pallas_kernels.stacked import materialize
from tokenspeed_jax.models import cpu_dot
from tokenspeed_jax.models.block_quant import block_matmul, check_blocks, quantize_blocks
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.quant import BLOCK_MODES, qmatmul, quantize_columns, use_native
from tokenspeed_jax.models.rope import rope_parameters


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


class Linear(nnx.Module):
    """y = x @ kernel (+ bias). kernel f[in, out]; bias f[out] or absent. Quantized
    (`quantize`, `models.quant`): kernel int8[in, out] and kernel_scale f32[out]. GGUF blocks
    (`set_blocks`, `models.block_quant`): kernel int8[in, out] codes, kernel_scale f32[in/32, out],
    kernel_min f32[in/32, out] (Q4_1) or None. Tiled (`tile`, XLA:CPU with the native kernel):
    kernel [out / 16, in, 16] instead of [in, out], same dtype and scales."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, cfg: ModelConfig, rngs: nnx.Rngs):
        self.kernel = normal_param(rngs, (d_in, d_out), cfg.init_scale / d_in**0.5, cfg.dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), cfg.dtype)) if bias else None
        self.kernel_scale: nnx.Param | None = None
        self.kernel_min: nnx.Param | None = None
        self.quant_mode: str | None = None

    def quantize(self, mode: str) -> None:
        """Replace the float kernel by int8 + per-output-channel scales (`models.quant`), or
        by Q8_0 blocks (mode "q8_0", `models.block_quant`)."""
        if mode == "q8_0":
            self.set_blocks(*quantize_blocks(self.kernel.get_value()), None, mode=mode)
            return
        q, scale = quantize_columns(self.kernel.get_value())
        self.kernel = nnx.Param(q)
        self.kernel_scale = nnx.data(nnx.Param(scale))  # was None: a static attribute
        self.quant_mode = mode

    def set_blocks(
        self, codes: jax.Array, scales: jax.Array, mins: jax.Array | None, *, mode: str = "gguf"
    ) -> None:
        """Hold GGUF Q8_0 / Q4_0 / Q4_1 blocks in place of the float kernel (shapes above)."""
        check_blocks(codes, scales, mins)
        if tuple(codes.shape) != tuple(self.kernel.get_value().shape):
            raise ValueError(f"{codes.shape=} does not match the kernel's {self.kernel.get_value().shape}")
        self.kernel = nnx.Param(codes)
        self.kernel_scale = nnx.data(nnx.Param(scales))  # were None: static attributes
        self.kernel_min = nnx.data(nnx.Param(mins)) if mins is not None else None
        self.quant_mode = mode

    def tile(self) -> bool:
        """Re-lay the kernel tile-major for the native CPU kernel (`pallas_kernels.
        block_matmul_cpu.pack_tiles`), which then takes every product of this layer: float32 /
        bf16 weights, int8 weight-only, GGUF / Q8_0 blocks (not w8a8: XLA's integer dot); out a
        multiple of 16. Returns whether it did. A few-row product streams each tile's weights in
        order: 30 chained bf16 576 x 1536 layers, 1 row, 10.5 -> 3.8 ms; float32 tiles beat XLA's
        own dot from 1 to 512 rows (3.2 vs 4.3 ms at 1 row, 176 vs 180 at 512;
        benchmarks/block_matmul.py)."""
        w = self.kernel.get_value()
        float_ok = self.quant_mode is None and w.dtype in (jnp.float32, jnp.bfloat16)
        if not tileable(w) or not (float_ok or self.quant_mode in ("int8", *BLOCK_MODES)):
            return False
        self.kernel = nnx.Param(pack_tiles(w))
        return True

    def absorb(self, others: list[Linear], shards: int = 1) -> bool:
        """Append `others`' output columns to this Linear (one product instead of several on
        the same input: q / k / v, gate / up). All must be laid out alike: same inputs, dtype,
        quantization, scale blocks, mins and bias presence; tiled (native CPU) or [in, out].
        shards (untiled only): the columns are interleaved per tensor-parallel shard,
        [a_0 b_0 | a_1 b_1 | ...] with a_s = shard s's contiguous 1/shards of a's columns, so a
        column-sharded fused kernel gives every shard its own part of each (`split_fused`
        reads it back). Returns whether it did."""
        mine = [self, *others]
        kernels = [m.kernel.get_value() for m in mine]
        tiled = kernels[0].ndim == 3
        same = (lambda k: k.shape[1:]) if tiled else (lambda k: k.shape[:-1])
        if any(
            k.ndim != kernels[0].ndim or same(k) != same(kernels[0]) or k.dtype != kernels[0].dtype
            for k in kernels
        ):
            return False
        if (tiled and shards != 1) or any(k.shape[-1] % shards for k in kernels):
            return False
        for attr in ("kernel_scale", "kernel_min", "bias"):
            vals = [getattr(m, attr) for m in mine]
            if any((v is None) != (vals[0] is None) for v in vals) or (
                vals[0] is not None and len({v.get_value().shape[:-1] for v in vals}) != 1
            ):
                return False
        if len({m.quant_mode for m in mine}) != 1:
            return False

        def join(arrays: list[jax.Array], axis: int) -> jax.Array:
            if shards == 1:
                return jnp.concatenate(arrays, axis=axis)
            parts = [jnp.split(a, shards, axis=-1) for a in arrays]
            return jnp.concatenate([p[s] for s in range(shards) for p in parts], axis=-1)

        self.kernel = nnx.Param(join(kernels, 0 if tiled else -1))
        for attr in ("kernel_scale", "kernel_min", "bias"):
            if getattr(self, attr) is not None:
                setattr(self, attr, nnx.Param(join([getattr(m, attr).get_value() for m in mine], -1)))
        return True

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.quant_mode in BLOCK_MODES and self.kernel_scale is not None:
            mins = self.kernel_min[...] if self.kernel_min is not None else None
            y = block_matmul(x, self.kernel[...], self.kernel_scale[...], mins)
        elif self.kernel_scale is not None and self.quant_mode is not None:
            y = qmatmul(x, self.kernel[...], self.kernel_scale[...], self.quant_mode)
        else:
            y = matmul(x, self.kernel[...])
        return y + self.bias[...] if self.bias is not None else y


def matmul(x: jax.Array, w: jax.Array, *, w_transposed: bool = False) -> jax.Array:
    """x f[..., K] @ w f[K, N] (w_transposed: w f[N, K], contracted on its last axis, e.g. a tied
    embedding table) in x's dtype, accumulated in float32.

    Tile-major w ([N / 16, K, 16], `Linear.tile` on one CPU device) goes to the native kernel
    (`pallas_kernels.block_matmul_cpu.dense_matmul_cpu`: the same f32 products and
    accumulation, another summation order). bf16 [K, N] weights on XLA:CPU too (1.2-1.6x XLA's
    bf16 dot). Elsewhere XLA's dot asked for a float32 result, which is what lets XLA:CPU run a
    bf16 dot natively (a bf16 result makes it upcast both operands first, i.e. convert every
    weight matrix on every step); a lone row goes as two on XLA:CPU (`cpu_dot`).
    """
    out_dtype = x.dtype
    if w.dtype == jnp.bfloat16 and x.dtype == jnp.float32:
        # float32 activations on bf16 weights (`CausalLM.activation_dtype`): the product's input
        # rounded as a bf16 model's (in the producer's fusion), its float32 sums kept
        x = x.astype(jnp.bfloat16)
    if w.ndim == 3 or (w.dtype == jnp.bfloat16 and not w_transposed and use_native()):
        # tile-major w: only this kernel takes it; a bf16 x goes in and y comes out in the
        # wanted dtype (the kernel converts: XLA:CPU's converts around each product were ~30%
        # of a bf16 512-token step)
        return dense_matmul_cpu(x, w, out_dtype)
    w = materialize(w)  # scan_layers: only the native kernel reads a stacked weight in place
    return cpu_dot.dot(x, w, 1 if w_transposed else 0, jnp.float32).astype(out_dtype)


def split_fused(y: jax.Array, widths: tuple[int, ...], shards: int = 1) -> list[jax.Array]:
    """The outputs of the Linears a fused Linear absorbed (`Linear.absorb`), widths[i] columns
    each, from y f[..., sum(widths)] laid out for `shards` tensor-parallel shards."""
    if shards == 1:
        return jnp.split(y, list(itertools.accumulate(widths[:-1])), axis=-1)
    lead = y.shape[:-1]
    y = y.reshape(*lead, shards, y.shape[-1] // shards)
    cuts = list(itertools.accumulate(w // shards for w in widths[:-1]))
    return [part.reshape(*lead, -1) for part in jnp.split(y, cuts, axis=-1)]


def fuse_linears(model: nnx.Module, shards: int = 1) -> int:
    """Fuse the projections that share an input (`fuse_projections`: attention q / k / v, MLP
    gate / up) of every module of `model`, laid out for `shards` tensor-parallel shards
    (`Linear.absorb`): 5 products a layer become 3 (fewer, larger GEMMs on accelerators).
    Returns how many modules fused."""
    fusers = [m for _, m in nnx.iter_graph(model) if callable(getattr(m, "fuse_projections", None))]
    return sum(bool(module.fuse_projections(shards)) for module in fusers)


def tile_linears(model: nnx.Module) -> int:
    """`Linear.tile` every Linear of `model` that takes it, and its tied table (`tile_table`,
    models.decoder.CausalLM), then fuse the projections that share an input (`fuse_projections`:
    attention q / k / v, MLP gate / up); returns how many Linears and tables were tiled. For
    one XLA:CPU device with the native kernel built (the runner's call): a kernel's layout is
    then the kernel's own, so nothing shards or reads it as [in, out] afterwards."""
    n = sum(module.tile() for _, module in nnx.iter_graph(model) if isinstance(module, Linear))
    tile_table = getattr(model, "tile_table", None)
    n += int(tile_table()) if callable(tile_table) else 0
    fuse_linears(model)
    return n


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + weight) over the last axis, all in float32, cast back at the end.

    weight f[dim]; offset = cfg.norm_weight_offset (0 for Llama-style, 1 for Gemma, whose
    weights are stored zero-centred and initialised to 0).
    """

    def __init__(self, dim: int, *, eps: float, cfg: ModelConfig):
        self.offset = float(cfg.norm_weight_offset)
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - self.offset, cfg.dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, layer: int = 0) -> jax.Array:
    """f32[head_dim // 2] inverse frequencies of layer `layer` (its theta and scaling, see
    `ModelConfig.rope_of`; models/rope.py)."""
    theta, scaling = cfg.rope_of(layer)
    inv_freq, _ = rope_parameters(cfg.rotary_dim, theta, scaling, cfg.max_position_embeddings)
    return jnp.asarray(inv_freq)


def rope_attention_factor(cfg: ModelConfig, layer: int = 0) -> float:
    """Factor the RoPE variant multiplies cos/sin by (YaRN mscale; 1.0 for most variants)."""
    theta, scaling = cfg.rope_of(layer)
    return rope_parameters(cfg.rotary_dim, theta, scaling, cfg.max_position_embeddings)[1]


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (Llama/Qwen/Mistral/LFM2/GPT-OSS layout). x f[T, H, D]; positions i32[T].
    inv_freq f32[D_r / 2]: a partial rotary (D_r < D) turns the first D_r dims, the rest pass."""
    rot = 2 * inv_freq.shape[0]
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], positions, inv_freq), x[..., rot:]], axis=-1)
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def activation(name: str):
    """Gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, tanh-approximated GELU)."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    raise ValueError(f"unsupported activation {name!r}")


class MLP(nnx.Module):
    """Gated MLP: down_proj(act(gate_proj(x)) * up_proj(x)), act = SiLU or tanh-GELU."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        # None once fused into gate_up_proj (`fuse_projections`)
        self.gate_proj: Linear | None = Linear(h, i, bias=b, cfg=cfg, rngs=rngs)
        self.up_proj: Linear | None = Linear(h, i, bias=b, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(i, h, bias=b, cfg=cfg, rngs=rngs)
        self.gate_up_proj: Linear | None = None  # gate and up in one (`fuse_projections`)
        self.fused_shards = 1  # gate_up_proj's column layout (`Linear.absorb`)
        self.act = activation(cfg.hidden_act)

    def fuse_projections(self, shards: int = 1) -> bool:
        """gate_proj and up_proj as one product (`Linear.absorb`); returns whether."""
        gate, up = self.gate_proj, self.up_proj
        if gate is None or up is None or not gate.absorb([up], shards):
            return False
        self.gate_up_proj = nnx.data(gate)  # was None: a static attribute
        self.gate_proj = self.up_proj = None
        self.fused_shards = shards
        return True

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate_up_proj is not None:
            y = self.gate_up_proj(x)
            gate, up = split_fused(y, (y.shape[-1] // 2,) * 2, self.fused_shards)
            return self.down_proj(self.act(gate) * up)
        assert self.gate_proj is not None and self.up_proj is not None
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
