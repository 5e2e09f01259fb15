"""The generic decoder (Flax NNX): attention / conv token mixers, gated MLP, RMSNorm, RoPE
(Gemma switches: sandwich norms, scaled embeddings, attention and final logit soft-caps).

Parameter names follow Hugging Face Llama/Qwen3 (`embed_tokens`, `layers[i].self_attn.q_proj`,
`input_layernorm`, `post_attention_layernorm`, `mlp.gate_proj`, `norm`, `lm_head`); conv layers
use `layers[i].conv.{in_proj, conv_weight, out_proj}` (LFM2's `conv.conv.weight` transposed).

Two forwards over the same parameters:
* `__call__` (paged): packed tokens of many requests, K/V and conv inputs written into the page
  pools at `batch.write_idx`, attention read through the page tables -> (hidden f[T, H], caches);
* `dense`: one whole sequence with plain causal / sliding masks and a plain conv (test oracle).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import kv_quant, pool_bits
from pallas_kernels.block_matmul_cpu import TILE
from tokenspeed_jax.models.batch import PagedBatch
from tokenspeed_jax.models.block_quant import block_matmul, check_blocks
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.conv import ShortConv
from tokenspeed_jax.models.dense_attention import dense_attention
from tokenspeed_jax.models.gated_delta import GatedDeltaNet
from tokenspeed_jax.models.layers import (
    MLP,
    Linear,
    RMSNorm,
    apply_rope,
    matmul,
    rope_attention_factor,
    rope_inv_freq,
    split_fused,
)
from tokenspeed_jax.models.mamba2 import Mamba2Mixer
from tokenspeed_jax.models.moe import MoE
from tokenspeed_jax.models.quant import qmatmul

AttnFn = Callable[..., jax.Array]  # SPEC.md paged_attention signature


# the mixer attribute of each non-attention layer type (HF names: LFM2 conv, Qwen3.5, Bamba)
_MIXERS = {"conv": "conv", "linear_attention": "linear_attn", "mamba": "mamba"}


class Attention(nnx.Module):
    """GQA attention with optional qk-norm, qkv bias, sinks, soft-cap and sliding window."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        h, hq, hkv, d = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        # None once fused into qkv_proj (`fuse_projections`)
        self.output_gate = cfg.attn_output_gate  # q_proj gives [q_h | gate_h] per head
        q_out = hq * d * (2 if self.output_gate else 1)
        self.q_proj: Linear | None = Linear(h, q_out, bias=cfg.attention_bias, cfg=cfg, rngs=rngs)
        self.k_proj: Linear | None = Linear(h, hkv * d, bias=cfg.attention_bias, cfg=cfg, rngs=rngs)
        self.v_proj: Linear | None = Linear(h, hkv * d, bias=cfg.attention_bias, cfg=cfg, rngs=rngs)
        self.o_proj = Linear(hq * d, h, bias=cfg.o_proj_bias, cfg=cfg, rngs=rngs)
        self.qkv_proj: Linear | None = None  # q, k and v in one (`fuse_projections`)
        self.fused_shards = 1  # qkv_proj's column layout (`Linear.absorb`)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, cfg=cfg) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, cfg=cfg) if cfg.qk_norm else None
        self.sinks = (
            nnx.Param(jax.random.normal(rngs.params(), (hq,), jnp.float32).astype(cfg.dtype))
            if cfg.attention_sinks
            else None
        )
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        # K/V pages and the attention kernels' q in the model dtype even when activations are
        # wider (`CausalLM.activation_dtype`): what a model of that dtype stores and reads
        self.kv_dtype = cfg.dtype
        self.sliding_window = cfg.window_of(layer)
        self.soft_cap = cfg.attn_logit_softcapping
        # YaRN scales cos/sin, i.e. both q and k, by f: the same as scaling the logits by f^2.
        self.sm_scale = cfg.scale * rope_attention_factor(cfg, layer) ** 2
        self.inv_freq = nnx.Variable(rope_inv_freq(cfg, layer))  # not a Param: never trained/loaded

    def fuse_projections(self, shards: int = 1) -> bool:
        """q_proj, k_proj and v_proj as one product (`Linear.absorb`); returns whether."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        if q is None or k is None or v is None or not q.absorb([k, v], shards):
            return False
        self.qkv_proj = nnx.data(q)  # was None: a static attribute
        self.q_proj = self.k_proj = self.v_proj = None
        self.fused_shards = shards
        return True

    def _qkv(self, x: jax.Array, positions: jax.Array):
        """x f[T, H] -> (q f[T, Hq, D], k, v f[T, Hkv, D], output gate f[T, Hq * D] or None)."""
        t = x.shape[0]
        dq, dkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        dq *= 2 if self.output_gate else 1
        if self.qkv_proj is not None:
            q, k, v = split_fused(self.qkv_proj(x), (dq, dkv, dkv), self.fused_shards)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.output_gate:  # per head: [q (D) | gate (D)]
            qg = q.reshape(t, self.num_heads, 2, self.head_dim)
            q, gate = qg[:, :, 0], qg[:, :, 1].reshape(t, -1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = self.inv_freq[...]
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v, gate

    def _out(self, out: jax.Array, gate: jax.Array | None) -> jax.Array:
        """Attention output f[T, Hq, D] -> f[T, H] (times sigmoid(gate) first, if gated)."""
        out = out.reshape(out.shape[0], -1)
        if gate is not None:
            out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)
        return self.o_proj(out)

    def _kwargs(self) -> dict:
        return dict(
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
            sinks=None if self.sinks is None else self.sinks[...],
        )

    def dense(self, x: jax.Array) -> jax.Array:
        q, k, v, gate = self._qkv(x, jnp.arange(x.shape[0], dtype=jnp.int32))
        return self._out(dense_attention(q, k, v, **self._kwargs()), gate)

    def paged(
        self, x: jax.Array, cache: dict, batch: PagedBatch, group: int, attn_fn: AttnFn
    ) -> tuple[jax.Array, dict]:
        """x f[T, H]; cache {"k", "v": f[P, B_g, Hkv, D]} (a quantized cache adds "k_scale",
        "v_scale": f16[P, B_g, Hkv], `kv_quant`) -> (f[T, H], new cache)."""
        q, k, v, gate = self._qkv(x, batch.positions)
        q, k, v = (a.astype(self.kv_dtype) for a in (q, k, v))
        idx = batch.write_idx[group]
        quantized = "k_scale" in cache
        new = {}
        for name, val in (("k", k), ("v", v)):
            pool = cache[name]
            p, bs = pool.shape[:2]
            rows = {name: val}
            if quantized:  # the rows' values and their per-token-head scales, one scatter each
                rows[name], rows[name + "_scale"] = kv_quant.quantize(val, kv_quant.value_dtype(pool.dtype))
            for key, val_rows in rows.items():
                flat = cache[key].reshape(p * bs, *cache[key].shape[2:])
                # a uint16 / uint8 pool takes 16- / 8-bit float rows as bits (pool_bits: XLA:CPU
                # has no bf16 scatter)
                new[key] = pool_bits.scatter_set(flat, idx, val_rows).reshape(cache[key].shape)
        scales = {"k_scales": new["k_scale"], "v_scales": new["v_scale"]} if quantized else {}
        out = attn_fn(
            q,
            new["k"],
            new["v"],
            batch.page_tables[group],
            batch.kv_lens,
            batch.cu_q_lens,
            batch.num_seqs,
            **self._kwargs(),
            **scales,
        )
        return self._out(out.astype(x.dtype), gate), new


def make_mlp(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """Feed-forward block factory: dense SwiGLU, or top-k routed experts (GPT-OSS, models/moe.py)."""
    if cfg.num_local_experts > 0:
        return MoE(cfg, rngs=rngs)
    return MLP(cfg, rngs=rngs)


class DecoderLayer(nnx.Module):
    """Pre-norm block.

    h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)).
    With `sandwich_norms` (Gemma 2/3) the outputs are normed too:
    h = x + post_attention_layernorm(mixer(input_layernorm(x)));
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))).
    """

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.layer_type = cfg.layer_types[layer]
        norm = lambda: RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
        self.input_layernorm = norm()
        if self.layer_type == "conv":
            self.conv = ShortConv(cfg, rngs=rngs)
        elif self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, rngs=rngs)
        elif self.layer_type == "mamba":
            self.mamba = Mamba2Mixer(cfg, rngs=rngs)
        else:
            self.self_attn = Attention(cfg, layer, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = make_mlp(cfg, rngs=rngs)

    def _residuals(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """x: the block input, y: the mixer's output -> the block output."""
        if not self.sandwich:
            h = x + y
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(y)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def dense(self, x: jax.Array) -> jax.Array:
        mixer = _MIXERS.get(self.layer_type, "self_attn")
        return self._residuals(x, getattr(self, mixer).dense(self.input_layernorm(x)))

    def paged(self, x, cache, batch: PagedBatch, group: int, attn_fn: AttnFn, conv_fn=None):
        y = self.input_layernorm(x)
        if self.layer_type == "conv":
            y, cache = self.conv.paged(y, cache, batch, group, conv_fn)
        elif self.layer_type in ("linear_attention", "mamba"):
            y, cache = getattr(self, _MIXERS[self.layer_type]).paged(y, cache, batch, group)
        else:
            y, cache = self.self_attn.paged(y, cache, batch, group, attn_fn)
        return self._residuals(x, y), cache


class CausalLM(nnx.Module):
    """Decoder-only LM. Params: embed_tokens f[V, H], layers, norm, lm_head (unless tied)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        emb = jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32)
        self.embed_tokens = nnx.Param(emb.astype(cfg.dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(len(cfg.layer_types))])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, cfg=cfg, rngs=rngs)
        )
        self.embed_scale = cfg.embed_scale
        self.final_softcap = cfg.final_logit_softcapping
        self.dtype = cfg.dtype
        # the residual stream's dtype (embed's output): the model dtype, or float32 for bf16
        # weights on the native CPU matmul (`runtime.prepare`: XLA:CPU runs bf16 elementwise ops
        # through converts; products still round their inputs to bf16)
        self.activation_dtype = cfg.dtype
        # quantized weights (`models.quant`): a tied table as int8 rows with a scale per row
        # (quant_mode "int8": f32[V]), or a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks (quant_mode
        # "gguf", `set_table_blocks`: scales f32[H / 32, V], Q4_1 mins in embed_min_q)
        self.embed_scale_q: nnx.Param | None = None
        self.embed_min_q: nnx.Param | None = None
        self.quant_mode: str | None = None

    def set_table_blocks(self, codes: jax.Array, scales: jax.Array, mins: jax.Array | None) -> None:
        """Hold a tied table as GGUF blocks: codes int8[V, H] (a row per token), scales and mins
        f32[V, H / 32] as the file stores them. The lm_head multiplies the blocks in the native
        kernel (`models.block_quant.block_matmul`, [K = H, N = V] blocks) and the embedding
        dequantizes only the gathered rows: SmolLM2's Q8_0 table is 31 MB read per decode step
        instead of a 113 MB float32 copy."""
        v, h = self.embed_tokens.get_value().shape
        if tuple(codes.shape) != (v, h) or codes.dtype != jnp.int8:
            raise ValueError(f"{codes.shape=} {codes.dtype=}: expected int8[{v}, {h}]")
        check_blocks(codes.T, scales.T, None if mins is None else mins.T)
        self.embed_tokens = nnx.Param(codes)
        self.embed_scale_q = nnx.data(nnx.Param(scales.T))  # were None: static attributes
        self.embed_min_q = nnx.data(nnx.Param(mins.T)) if mins is not None else None
        self.quant_mode = "gguf"

    def tile_table(self) -> bool:
        """A tied table as the tile-major lm_head weight (`layers.Linear.tile`): [V, H] ->
        [V / 16, H, 16], which the embedding reads by (id // 16, :, id % 16). For a float32 /
        bf16 or int8 weight-only table with V a multiple of 16; returns whether it did. SmolLM2
        bf16 batch-1 decode: 16.8 -> 14.9 ms a token."""
        table = self.embed_tokens.get_value()
        if table.ndim != 2:
            return False  # tiled already
        v, h = table.shape
        kind_ok = (
            self.quant_mode in ("int8", "gguf")
            if self.embed_scale_q is not None
            else table.dtype in (jnp.bfloat16, jnp.float32)
        )
        if self.lm_head is not None or not kind_ok or v % TILE:
            return False
        self.embed_tokens = nnx.Param(table.reshape(v // TILE, TILE, h).transpose(0, 2, 1))
        return True

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """i32[T] -> f[T, H]; Gemma scales by sqrt(H) rounded to the model dtype, as HF does."""
        table = self.embed_tokens[...]
        if table.ndim == 3:  # tile-major (`tile_table`)
            x = table[token_ids // TILE, :, token_ids % TILE]
        else:
            x = table[token_ids]
        if self.quant_mode == "gguf" and self.embed_scale_q is not None:  # blocks of 32 inputs
            t, h = x.shape
            w = x.astype(jnp.float32).reshape(t, h // 32, 32)
            w = w * self.embed_scale_q[...][:, token_ids].T[..., None]
            if self.embed_min_q is not None:
                w = w + self.embed_min_q[...][:, token_ids].T[..., None]
            x = w.reshape(t, h).astype(self.dtype)
        elif self.embed_scale_q is not None:  # int8 rows: dequantize only the gathered ones
            x = (x.astype(jnp.float32) * self.embed_scale_q[...][token_ids][:, None]).astype(self.dtype)
        x = x if self.embed_scale is None else x * jnp.asarray(self.embed_scale, x.dtype)
        return x.astype(self.activation_dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden f[..., H] -> float32 logits f32[..., V] (soft-capped for Gemma 2)."""
        if self.lm_head is None and self.quant_mode == "gguf" and self.embed_scale_q is not None:
            table = self.embed_tokens[...]  # [V, H] rows, or tile-major [V / 16, H, 16]
            out = block_matmul(
                hidden,
                table if table.ndim == 3 else table.T,
                self.embed_scale_q[...],
                None if self.embed_min_q is None else self.embed_min_q[...],
            )
        elif self.lm_head is None and self.embed_scale_q is not None and self.quant_mode:
            table = self.embed_tokens[...]
            out = qmatmul(
                hidden, table, self.embed_scale_q[...], self.quant_mode, q_transposed=table.ndim == 2
            )
        elif self.lm_head is None:
            table = self.embed_tokens[...]
            out = matmul(hidden, table, w_transposed=table.ndim == 2)
        else:
            out = self.lm_head(hidden)
        out = out.astype(jnp.float32)
        if self.final_softcap is not None:
            out = self.final_softcap * jnp.tanh(out / self.final_softcap)
        return out

    def __call__(
        self,
        token_ids: jax.Array,
        caches: tuple[dict, ...],
        batch: PagedBatch,
        attn_fn: AttnFn,
        conv_fn: Callable | None = None,
    ) -> tuple[jax.Array, tuple[dict, ...]]:
        """Paged forward of packed tokens i32[T] -> (final-normed hidden f[T, H], new caches).

        attn_fn: SPEC.md `paged_attention` signature; conv_fn: `short_conv` signature or None
        (jnp taps).
        """
        x = self.embed(token_ids)
        new_caches = []
        for i, layer in enumerate(self.layers):
            x, c = layer.paged(x, caches[i], batch, batch.layer_groups[i], attn_fn, conv_fn)
            new_caches.append(c)
        return self.norm(x), tuple(new_caches)

    def dense(self, token_ids: jax.Array) -> jax.Array:
        """One whole sequence i32[S] -> logits f32[S, V] (plain masks; test oracle)."""
        x = self.embed(token_ids)
        for layer in self.layers:
            x = layer.dense(x)
        return self.logits(self.norm(x))
