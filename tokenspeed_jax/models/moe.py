"""Mixture-of-experts feed-forward (GPT-OSS style), token-dropless, grouped by expert.

router: logits = x @ W_r + b_r; the top-k logits of each token are soft-maxed among themselves
(weights over the selected experts only). Expert e: clamped SwiGLU with biases,
  gate = min(x @ G_e + bg_e, limit); up = clip(x @ U_e + bu_e, -limit, limit)
  h = (up + 1) * gate * sigmoid(alpha * gate);  y_e = h @ D_e + bd_e
and the token's output is the routing-weighted sum over its k experts.

Compute: the T*k (token, expert) pairs are sorted by expert and run through `jax.lax.ragged_dot`
(one grouped matmul per projection), so the work is proportional to T*k, not T*E, and the shapes
stay static (jit-friendly: group sizes are data, not shapes). HF stores gate/up interleaved in one
`gate_up_proj`; the loader splits them into `gate_proj` / `up_proj` here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.layers import Linear, normal_param


class Experts(nnx.Module):
    """Params: gate_proj, up_proj f[E, H, I]; down_proj f[E, I, H]; gate_bias, up_bias f[E, I];
    down_bias f[E, H]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        s = cfg.init_scale
        self.gate_proj = normal_param(rngs, (e, h, i), s / h**0.5, cfg.dtype)
        self.up_proj = normal_param(rngs, (e, h, i), s / h**0.5, cfg.dtype)
        self.down_proj = normal_param(rngs, (e, i, h), s / i**0.5, cfg.dtype)
        self.gate_bias = nnx.Param(jnp.zeros((e, i), cfg.dtype))
        self.up_bias = nnx.Param(jnp.zeros((e, i), cfg.dtype))
        self.down_bias = nnx.Param(jnp.zeros((e, h), cfg.dtype))
        self.alpha = cfg.swiglu_alpha
        self.limit = cfg.swiglu_limit

    def _act(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.limit is not None:
            gate = jnp.minimum(gate, self.limit)  # only from above: large negatives gate to ~0
            up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1.0) * gate * jax.nn.sigmoid(self.alpha * gate)

    def __call__(self, xs: jax.Array, experts: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """xs f[N, H] rows sorted by expert; experts i32[N] their expert; group_sizes i32[E]."""
        gate = jax.lax.ragged_dot(xs, self.gate_proj[...], group_sizes) + self.gate_bias[...][experts]
        up = jax.lax.ragged_dot(xs, self.up_proj[...], group_sizes) + self.up_bias[...][experts]
        h = self._act(gate, up).astype(xs.dtype)
        return jax.lax.ragged_dot(h, self.down_proj[...], group_sizes) + self.down_bias[...][experts]


class MoE(nnx.Module):
    """Top-k routed experts. Params: router (Linear H -> E with bias), experts (`Experts`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not 0 < cfg.num_experts_per_tok <= cfg.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_local_experts={cfg.num_local_experts}], "
                f"got {cfg.num_experts_per_tok}"
            )
        self.router = Linear(cfg.hidden_size, cfg.num_local_experts, bias=True, cfg=cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_local_experts

    def __call__(self, x: jax.Array) -> jax.Array:
        """x f[T, H] -> f[T, H]."""
        t, k = x.shape[0], self.top_k
        logits = self.router(x).astype(jnp.float32)
        top_logits, top_idx = jax.lax.top_k(logits, k)  # [T, k]
        weights = jax.nn.softmax(top_logits, axis=-1)
        flat_expert = top_idx.reshape(-1)  # pair p = (token p // k, slot p % k)
        order = jnp.argsort(flat_expert, stable=True)
        experts = flat_expert[order]
        token = order // k
        group_sizes = jnp.bincount(flat_expert, length=self.num_experts).astype(jnp.int32)
        out = self.experts(x[token], experts, group_sizes)
        out = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(out).astype(x.dtype)
