"""Tensor-parallel layout of the recurrent token mixers (Gated DeltaNet, Mamba2): heads sharded.

Both mixers project the input once into several head-major parts that a short conv then mixes
channel by channel. Column-sharding that projection gives each shard a contiguous 1/tp of its
columns, which would cut across the parts; so, as `sharding.relayout_conv` does for LFM2's gates,
the projection's columns (and the conv's channels, hence the `conv_state` pool that stores them)
are re-laid per shard, `[parts of shard 0 | parts of shard 1 | ...]`, and the module's
`head_shards` tells its forward how to read them back. Every shard then runs the conv, the
recurrence and the state pools of its own heads; out_proj is row-parallel (one all-reduce per
layer, as attention). Mathematically the forward is unchanged.

* Gated DeltaNet (`models.gated_delta`): conv channels `[q | k | v]` (key, key, value heads) ->
  `[q_s k_s v_s]` per shard; in_proj_z / b / a, dt_bias and A_log are head-major already (plain
  column sharding). Pools: ssm f32[P, Hv, Dk, Dv] on Hv, conv_state f32[P, K-1, C] on C. Needs
  tp | linear_num_key_heads (so tp | the value heads too).
* Mamba2 (`models.mamba2`): in_proj `[z | x | B | C | dt]` -> `[z_s x_s B_s C_s dt_s]`. B and C
  have G groups, each read by H/G consecutive heads: with G % tp == 0 shard s holds groups
  `[s G/tp, (s+1) G/tp)`; with tp % G == 0 each shard needs the single group its heads read, so
  B and C are replicated onto the shards that share it (vLLM does the same) and the runtime
  config says `mamba_n_groups = tp` (the conv, its weights and its pool widen by that much). The
  gated norm keeps the checkpoint's G groups over the value channels: where one group spans
  several shards GSPMD reduces across them. Pools: ssm f32[P, H, Dh, N] on H, conv_state on C.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.gated_delta import GatedDeltaNet
from tokenspeed_jax.models.mamba2 import Mamba2Mixer


def validate(config: ModelConfig, tp: int) -> None:
    """ValueError naming the recurrent size `tp` does not divide."""
    types = set(config.layer_types)
    checks = []
    if "linear_attention" in types:
        checks.append(("linear_num_key_heads", config.linear_num_key_heads))
    if "mamba" in types:
        checks.append(("mamba_n_heads", config.mamba_n_heads))
        g = config.mamba_n_groups
        if g % tp and tp % g:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide mamba_n_groups={g} "
                f"(nor is it a multiple of it, which would replicate the B / C groups)"
            )
    for name, size in checks:
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={size}")


def runtime_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config the pools are sized from: Mamba2's B / C groups replicated up to tp."""
    if "mamba" in config.layer_types and tp > config.mamba_n_groups:
        return dataclasses.replace(config, mamba_n_groups=tp)
    return config


def _shard_cols(offset: int, width: int, s: int, n: int) -> np.ndarray:
    return offset + s * (width // n) + np.arange(width // n)


def delta_columns(kd: int, vd: int, n: int) -> np.ndarray:
    """Gated DeltaNet conv channels for n shards: [q_s k_s v_s] of every shard in turn."""
    return np.concatenate(
        [
            np.concatenate(
                [_shard_cols(0, kd, s, n), _shard_cols(kd, kd, s, n), _shard_cols(2 * kd, vd, s, n)]
            )
            for s in range(n)
        ]
    )


def _groups_of(s: int, g: int, n: int) -> range:
    """The B / C groups shard s's heads read (G % n == 0: G/n of them; else the one)."""
    return range(s * g // n, (s + 1) * g // n) if g % n == 0 else range(s * g // n, s * g // n + 1)


def mamba_columns(inner: int, g: int, dstate: int, heads: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Mamba2 (in_proj columns, conv channels) for n shards, each shard [z_s x_s B_s C_s dt_s]
    (conv: [x_s B_s C_s]); the B / C columns of a group repeat on every shard that reads it."""
    gn = g * dstate
    proj, conv = [], []
    for s in range(n):
        groups = _groups_of(s, g, n)
        b = np.concatenate([j * dstate + np.arange(dstate) for j in groups])
        x = _shard_cols(0, inner, s, n)
        proj += [_shard_cols(0, inner, s, n), inner + x, 2 * inner + b, 2 * inner + gn + b]
        proj.append(_shard_cols(2 * inner + 2 * gn, heads, s, n))
        conv += [x, inner + b, inner + gn + b]
    return np.concatenate(proj), np.concatenate(conv)


def relayout_recurrent(model, tp: int, take) -> int:
    """Re-lays every Gated DeltaNet / Mamba2 layer of `model` for `tp` head shards (in place;
    a layer already laid out for tp is left alone); `take(x, index, axis)` gathers columns
    (`sharding._take`: arrays or lazy parameter sources). Returns how many layers it re-laid."""
    done = 0
    for layer in model.layers:
        mixer = getattr(layer, "linear_attn", None) or getattr(layer, "mamba", None)
        if mixer is None or mixer.head_shards == tp:
            continue
        if mixer.head_shards != 1:
            raise ValueError(
                f"a recurrent layer laid out for {mixer.head_shards} shards cannot be re-laid for {tp}"
            )
        if isinstance(mixer, GatedDeltaNet):
            kd, vd = mixer.num_k_heads * mixer.head_k_dim, mixer.num_v_heads * mixer.head_v_dim
            conv = delta_columns(kd, vd, tp)
            proj, cols = mixer.in_proj_qkv, conv
        else:
            cols, conv = mamba_columns(mixer.inner, mixer.groups, mixer.state_size, mixer.num_heads, tp)
            proj = mixer.in_proj
        proj.kernel.set_value(take(proj.kernel.get_value(), cols, axis=1))
        if proj.bias is not None:
            proj.bias.set_value(take(proj.bias.get_value(), cols, axis=0))
        mixer.conv_weight.set_value(take(mixer.conv_weight.get_value(), conv, axis=1))
        if isinstance(mixer, Mamba2Mixer):
            if mixer.conv_bias is not None:
                mixer.conv_bias.set_value(take(mixer.conv_bias.get_value(), conv, axis=0))
            mixer.bc_groups = max(mixer.groups, tp)
            mixer.conv_dim = int(conv.size)
        mixer.head_shards = tp
        done += 1
    return done
