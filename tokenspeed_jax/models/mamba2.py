"""Mamba2 token mixer (Bamba / Granite 4.0 hybrid "mamba" layers), dense and paged.

in_proj -> [gate z (H*P) | xBC (C = H*P + 2*G*N) | dt (H)]; xBC -> short causal conv (kernel K,
with bias, SiLU) -> x f[T, H, P], B, C f[T, G, N]; dt = clamp(softplus(dt + dt_bias)), A =
-exp(A_log); the selective state space recurrence (`pallas_kernels.mamba2_ssd`) gives y per head,
plus the skip D * x; y = RMSNorm_per_group(y * silu(z)) (the gate goes in BEFORE the norm, unlike
Qwen3.5's gated norm); out_proj.

State in the page pool: the SSM state f32[H, P, N] and the conv tail f32[K-1, C], one snapshot per
page of the state cache group, read and written as models/recurrent_state.py describes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.mamba2_ssd import Mamba2Config, ssd_chunked, ssd_packed
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
    """A Mamba2 layer's pools: {"ssm": f32[P, H, Dh, N], "conv_state": f32[P, K-1, C]}."""
    return {
        "ssm": (num_pages, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state),
        "conv_state": (num_pages, cfg.mamba_d_conv - 1, cfg.mamba_conv_dim),
    }


class GroupGatedRMSNorm(nnx.Module):
    """RMSNorm of x * silu(gate) over each of G equal channel groups, times weight (HF
    `BambaRMSNormGated` / `MambaRMSNormGated` with norm_before_gate=False)."""

    def __init__(self, dim: int, groups: int, *, eps: float, dtype: str):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.groups, self.eps = groups, eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        grouped = y.reshape(*y.shape[:-1], self.groups, -1)
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * grouped.reshape(y.shape).astype(x.dtype)


class Mamba2Mixer(nnx.Module):
    """Params (HF names under `mamba`): in_proj [H_model, 2*H*P + 2*G*N + H], conv_weight [K, C]
    (HF `conv1d.weight` [C, 1, K] transposed), conv_bias [C], dt_bias [H], A_log [H], D [H],
    norm.weight [H*P], out_proj [H*P, H_model]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.mamba_n_heads, cfg.mamba_d_head
        self.groups, self.state_size = cfg.mamba_n_groups, cfg.mamba_d_state
        self.kernel_size, self.conv_dim = cfg.mamba_d_conv, cfg.mamba_conv_dim
        self.inner = self.num_heads * self.head_dim
        self.dt_limit = cfg.mamba_dt_limit
        bias = cfg.mamba_proj_bias
        self.in_proj = Linear(h, self.inner + self.conv_dim + self.num_heads, bias=bias, cfg=cfg, rngs=rngs)
        k = self.kernel_size
        w = jax.random.normal(rngs.params(), (k, self.conv_dim), jnp.float32) * cfg.init_scale / k**0.5
        self.conv_weight = nnx.Param(w.astype(cfg.dtype))
        self.conv_bias = nnx.Param(jnp.zeros((self.conv_dim,), cfg.dtype)) if cfg.mamba_conv_bias else None
        self.dt_bias = nnx.Param(jnp.ones((self.num_heads,), cfg.dtype))
        a = jax.random.uniform(rngs.params(), (self.num_heads,), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(cfg.dtype))
        self.D = nnx.Param(jnp.ones((self.num_heads,), cfg.dtype))
        self.norm = GroupGatedRMSNorm(self.inner, self.groups, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.out_proj = Linear(self.inner, h, bias=bias, cfg=cfg, rngs=rngs)
        self.config = Mamba2Config()
        # in_proj layout: 1 = [z | x | B | C | dt]; n = the tensor-parallel re-layout
        # (`runtime.recurrent_shards`), [z_s x_s B_s C_s dt_s] per shard, B / C holding the
        # groups the shard's heads read (bc_groups in all: G, or n when groups are replicated)
        self.head_shards, self.bc_groups = 1, self.groups

    # ------------------------------------------------------------------ shared pieces
    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x f[T, H_model] -> (gate f[T, H*P], conv input f32[T, C], dt f32[T, H] after
        softplus and the clamp)."""
        t, n = x.shape[0], self.head_shards
        proj = self.in_proj(x).reshape(t, n, -1)
        inner, conv = self.inner // n, self.conv_dim // n  # one shard's
        gate = proj[:, :, :inner].reshape(t, self.inner)
        mixed = proj[:, :, inner : inner + conv].reshape(t, self.conv_dim).astype(jnp.float32)
        dt = proj[:, :, inner + conv :].reshape(t, self.num_heads).astype(jnp.float32)
        dt = jax.nn.softplus(dt + self.dt_bias[...].astype(jnp.float32))
        lo, hi = self.dt_limit
        if (lo, hi) != (0.0, float("inf")):
            dt = jnp.clip(dt, lo, hi)
        return gate, mixed, dt

    def _conv(self, windows: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Conv windows f32[T, K, C] -> x f32[T, H, P], B, C f32[T, G, N]."""
        y = jnp.einsum("tkc,kc->tc", windows, self.conv_weight[...].astype(jnp.float32))
        if self.conv_bias is not None:
            y = y + self.conv_bias[...].astype(jnp.float32)
        # the model dtype's rounding where HF has it (the conv output is in the model dtype)
        y = jax.nn.silu(y).astype(dtype).astype(jnp.float32)
        t, n = y.shape[0], self.head_shards
        inner, gn = self.inner // n, self.bc_groups * self.state_size // n  # one shard's
        y = y.reshape(t, n, -1)
        xs = y[:, :, :inner].reshape(t, self.num_heads, self.head_dim)
        b = y[:, :, inner : inner + gn].reshape(t, self.bc_groups, self.state_size)
        c = y[:, :, inner + gn :].reshape(t, self.bc_groups, self.state_size)
        return xs, b, c

    def _finish(self, y: jax.Array, xs: jax.Array, gate: jax.Array, dtype) -> jax.Array:
        """SSM output f32[T, H, P] (+ the D skip) -> f[T, H_model]."""
        y = y + self.D[...].astype(jnp.float32)[:, None] * xs
        return self.out_proj(self.norm(y.reshape(y.shape[0], -1).astype(dtype), gate))

    def _a(self) -> jax.Array:
        return -jnp.exp(self.A_log[...].astype(jnp.float32))

    # ------------------------------------------------------------------ forwards
    def dense(self, x: jax.Array) -> jax.Array:
        """One whole sequence x f[S, H_model] -> f[S, H_model] from a zero state (test oracle)."""
        gate, mixed, dt = self._project(x)
        xs, b, c = self._conv(dense_windows(mixed, self.kernel_size), x.dtype)
        y, _ = ssd_chunked(xs, dt, self._a(), b, c, None, self.config)
        return self._finish(y, xs, gate, x.dtype)

    def paged(self, x: jax.Array, cache: dict, batch: PagedBatch, group: int) -> tuple[jax.Array, dict]:
        """Packed tokens x f[T, H_model]; cache {"ssm": f32[P, H, Dh, N], "conv_state":
        f32[P, K-1, C]} -> (f[T, H_model], new cache)."""
        gate, mixed, dt = self._project(x)
        ssm0, tail0 = read_states(cache, batch, group)
        windows = conv_windows(mixed, tail0, batch.cu_q_lens, self.kernel_size)
        xs, b, c = self._conv(windows, x.dtype)
        chunk, align, pages = snapshot_plan(batch, group, cache["ssm"].shape[0], self.config.chunk_size)
        y, ssm1, pool = ssd_packed(
            xs, dt, self._a(), b, c, ssm0, batch.cu_q_lens, batch.num_seqs,
            dataclasses.replace(self.config, chunk_size=chunk), align,  # keeps its chunk_impl
            (cache["ssm"], pages),
        )  # fmt: skip
        return self._finish(y, xs, gate, x.dtype), store_states(
            cache, batch, group, pool, ssm1, windows, tail0, pages
        )
