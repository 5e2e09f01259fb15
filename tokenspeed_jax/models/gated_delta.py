"""Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next "linear_attention" layers), dense and paged.

in_proj_qkv -> short causal conv (kernel K, SiLU) -> q, k (key heads, L2-normalized, q scaled by
Dk ** -0.5), v (value heads); beta = sigmoid(in_proj_b), log-decay g = -exp(A_log) *
softplus(in_proj_a + dt_bias); the gated delta rule (`pallas_kernels.gated_delta`) gives o per
value head; o = RMSNorm(o) * silu(in_proj_z); out_proj.

State in the page pool (paged form): a request's recurrent state is the delta-rule matrix
f32[Hv, Dk, Dv] plus its conv tail (the K-1 last conv inputs, f32[K-1, C]), one snapshot per page
of the state cache group: the page of slot s holds the state after the last token the request
has cached in slot s (models/recurrent_state.py reads and writes them). A snapshot that ends
exactly on a page boundary is what the scheduler publishes for the prefix cache, so a later
request sharing the prefix starts from it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.gated_delta import GatedDeltaConfig, gated_delta_chunked, gated_delta_packed, l2norm
from tokenspeed_jax.models.batch import PagedBatch
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.layers import Linear
from tokenspeed_jax.models.recurrent_state import (
    conv_windows,
    dense_windows,
    read_states,
    snapshot_plan,
    store_states,
)


def state_pool_shapes(cfg: ModelConfig, num_pages: int) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's pools: {"ssm": f32[P, Hv, Dk, Dv], "conv_state": f32[P, K-1, C]}."""
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return {
        "ssm": (num_pages, hv, dk, dv),
        "conv_state": (num_pages, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim),
    }


class GatedRMSNorm(nnx.Module):
    """RMSNorm over the value head dim, then times silu(gate) (HF `Qwen3_5RMSNormGated`; its
    weight is stored as is, not zero-centred like the model's other norms)."""

    def __init__(self, dim: int, *, eps: float, dtype: str):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = self.weight[...] * x32.astype(x.dtype)
        return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """Params (HF names under `linear_attn`): in_proj_qkv [H, C], in_proj_z [H, Hv*Dv],
    in_proj_b / in_proj_a [H, Hv], conv_weight [K, C] (HF `conv1d.weight` [C, 1, K] transposed),
    dt_bias [Hv], A_log [Hv], norm.weight [Dv], out_proj [Hv*Dv, H]; C = 2*Hk*Dk + Hv*Dv."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel_size = cfg.linear_conv_kernel_dim
        conv_dim, value_dim = cfg.linear_conv_dim, self.num_v_heads * self.head_v_dim
        self.in_proj_qkv = Linear(h, conv_dim, bias=False, cfg=cfg, rngs=rngs)
        self.in_proj_z = Linear(h, value_dim, bias=False, cfg=cfg, rngs=rngs)
        self.in_proj_b = Linear(h, self.num_v_heads, bias=False, cfg=cfg, rngs=rngs)
        self.in_proj_a = Linear(h, self.num_v_heads, bias=False, cfg=cfg, rngs=rngs)
        k = self.kernel_size
        w = jax.random.normal(rngs.params(), (k, conv_dim), jnp.float32) * cfg.init_scale / k**0.5
        self.conv_weight = nnx.Param(w.astype(cfg.dtype))
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), cfg.dtype))
        a = jax.random.uniform(rngs.params(), (self.num_v_heads,), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(cfg.dtype))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.out_proj = Linear(value_dim, h, bias=False, cfg=cfg, rngs=rngs)
        self.config = GatedDeltaConfig()
        # conv channel layout: 1 = [q | k | v]; n = the tensor-parallel re-layout
        # (`runtime.recurrent_shards`), [q_0 k_0 v_0 | ... | q_n-1 k_n-1 v_n-1]: each shard's heads local
        self.head_shards = 1

    # ------------------------------------------------------------------ shared pieces
    def _project(self, x: jax.Array):
        """x f[T, H] -> (conv input f32[T, C], z, beta f32[T, Hv], g f32[T, Hv])."""
        mixed = self.in_proj_qkv(x).astype(jnp.float32)
        z = self.in_proj_z(x)
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))
        a = self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)
        return mixed, z, beta, g

    def _qkv(self, conv_out: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """SiLU'd conv output f32[T, C] -> q, k f32[T, Hv, Dk] (normalized, key heads repeated
        onto their value heads), v f32[T, Hv, Dv]."""
        t = conv_out.shape[0]
        # the model dtype's rounding where HF has it (the conv output is in the model dtype)
        conv_out = conv_out.astype(dtype).astype(jnp.float32)
        n = self.head_shards
        kd = self.num_k_heads * self.head_k_dim // n  # one shard's q (and k) channels
        y = conv_out.reshape(t, n, -1)
        q = y[:, :, :kd].reshape(t, self.num_k_heads, self.head_k_dim)
        k = y[:, :, kd : 2 * kd].reshape(t, self.num_k_heads, self.head_k_dim)
        v = y[:, :, 2 * kd :].reshape(t, self.num_v_heads, self.head_v_dim)
        rep = self.num_v_heads // self.num_k_heads
        q = jnp.repeat(l2norm(q), rep, axis=1) * self.head_k_dim**-0.5
        k = jnp.repeat(l2norm(k), rep, axis=1)
        return q, k, v

    def _finish(self, core: jax.Array, z: jax.Array, dtype) -> jax.Array:
        """Delta-rule output f32[T, Hv, Dv] -> f[T, H]."""
        t = core.shape[0]
        gated = self.norm(core.astype(dtype), z.reshape(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(gated.reshape(t, -1))

    def _conv(self, window: jax.Array) -> jax.Array:
        """Conv windows f32[..., K, C] (oldest first) -> SiLU(sum_j w[j] * window[j])."""
        w = self.conv_weight[...].astype(jnp.float32)
        return jax.nn.silu(jnp.einsum("...kc,kc->...c", window, w))

    # ------------------------------------------------------------------ forwards
    def dense(self, x: jax.Array) -> jax.Array:
        """One whole sequence x f[S, H] -> f[S, H] from a zero state (test oracle)."""
        mixed, z, beta, g = self._project(x)
        q, kk, v = self._qkv(self._conv(dense_windows(mixed, self.kernel_size)), x.dtype)
        core, _ = gated_delta_chunked(q, kk, v, g, beta, None, self.config)
        return self._finish(core, z, x.dtype)

    def paged(self, x: jax.Array, cache: dict, batch: PagedBatch, group: int) -> tuple[jax.Array, dict]:
        """Packed tokens x f[T, H]; cache {"ssm": f32[P, Hv, Dk, Dv], "conv_state":
        f32[P, K-1, C]} -> (f[T, H], new cache). Rows start from their `state_read` snapshot and
        leave their final one at `state_write` (models/recurrent_state.py)."""
        mixed, z, beta, g = self._project(x)
        ssm0, tail0 = read_states(cache, batch, group)
        windows = conv_windows(mixed, tail0, batch.cu_q_lens, self.kernel_size)
        q, kk, v = self._qkv(self._conv(windows), x.dtype)
        c, align, pages = snapshot_plan(batch, group, cache["ssm"].shape[0], self.config.chunk_size)
        config = dataclasses.replace(self.config, chunk_size=c)  # keeps its chunk_impl
        core, ssm1, pool = gated_delta_packed(
            q, kk, v, g, beta, ssm0, batch.cu_q_lens, batch.num_seqs, config, align,
            (cache["ssm"], pages),
        )  # fmt: skip
        return self._finish(core, z, x.dtype), store_states(
            cache, batch, group, pool, ssm1, windows, tail0, pages
        )
