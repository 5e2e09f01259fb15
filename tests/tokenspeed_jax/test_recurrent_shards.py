"""The tensor-parallel layout of the recurrent mixers (runtime/recurrent_shards.py), on one device:
the column maps (literal), a mixer re-laid for n shards computes what it did before (its forward
reads the layout back), and sizes tp cannot split are ValueErrors. The sharded runs themselves
(4 virtual devices) are in test_parallel.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.models.gated_delta import GatedDeltaNet
from tokenspeed_jax.models.mamba2 import Mamba2Mixer
from tokenspeed_jax.models.registry import tiny_hybrid_config
from tokenspeed_jax.runtime import recurrent_shards, sharding


class _Layer(nnx.Module):
    def __init__(self, name: str, mixer: nnx.Module):
        setattr(self, name, mixer)


class _Net(nnx.Module):
    def __init__(self, layers):
        self.layers = nnx.List(layers)


def _mamba_config(groups: int):
    return dataclasses.replace(
        tiny_hybrid_config(), layer_types=("mamba", "full_attention"), mamba_n_heads=4, mamba_d_head=8,
        mamba_n_groups=groups, mamba_d_state=4, mamba_proj_bias=True, mamba_conv_bias=True,
    )  # fmt: skip


def test_delta_columns_literal():
    # q, k 4 channels each, v 8; two shards: [q0 q1 k0 k1 v0..v3] for shard 0
    cols = recurrent_shards.delta_columns(4, 8, 2)
    assert cols.tolist() == [0, 1, 4, 5, 8, 9, 10, 11, 2, 3, 6, 7, 12, 13, 14, 15]
    assert recurrent_shards.delta_columns(4, 8, 1).tolist() == list(range(16))


def test_mamba_columns_literal():
    # inner 4 (2 heads of 2), G = 1 group of N = 2, 2 shards: the group's B / C repeat on both
    proj, conv = recurrent_shards.mamba_columns(inner=4, g=1, dstate=2, heads=2, n=2)
    # canonical in_proj: z 0-3 | x 4-7 | B 8-9 | C 10-11 | dt 12-13
    assert proj.tolist() == [0, 1, 4, 5, 8, 9, 10, 11, 12, 2, 3, 6, 7, 8, 9, 10, 11, 13]
    # canonical conv: x 0-3 | B 4-5 | C 6-7
    assert conv.tolist() == [0, 1, 4, 5, 6, 7, 2, 3, 4, 5, 6, 7]
    # G = 2 groups, 2 shards: one group each, nothing repeated
    proj, conv = recurrent_shards.mamba_columns(inner=4, g=2, dstate=1, heads=2, n=2)
    assert sorted(proj.tolist()) == list(range(4 + 4 + 2 + 2 + 2))
    assert conv.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


CASES = {
    "gated_delta_2": (tiny_hybrid_config, "linear_attn", GatedDeltaNet, 2),
    "mamba2_g2_2": (lambda: _mamba_config(2), "mamba", Mamba2Mixer, 2),  # groups split
    "mamba2_g2_4": (lambda: _mamba_config(2), "mamba", Mamba2Mixer, 4),  # groups replicated
    "mamba2_g1_2": (lambda: _mamba_config(1), "mamba", Mamba2Mixer, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_relaid_mixer_computes_the_same(case):
    make_cfg, name, mixer_cls, n = CASES[case]
    cfg = make_cfg()
    net = _Net([_Layer(name, mixer_cls(cfg, rngs=nnx.Rngs(0)))])
    mixer = getattr(net.layers[0], name)
    # biases are zeros at init: give them values so their columns are checked too
    for p in (getattr(getattr(mixer, "in_proj", None), "bias", None), getattr(mixer, "conv_bias", None)):
        if p is not None:
            p.set_value(jax.random.normal(jax.random.key(3), p.get_value().shape, p.get_value().dtype))
    x = jax.random.normal(jax.random.key(1), (11, cfg.hidden_size), jnp.float32)
    ref = np.asarray(mixer.dense(x))
    runtime = sharding.relayout_recurrent(net, cfg, n)
    assert mixer.head_shards == n
    assert sharding.relayout_recurrent(net, cfg, n) == runtime  # idempotent
    np.testing.assert_allclose(np.asarray(mixer.dense(x)), ref, rtol=1e-5, atol=1e-6)
    if name == "mamba":  # the pools widen with the replicated groups, as the conv did
        assert runtime.mamba_n_groups == max(cfg.mamba_n_groups, n)
        assert mixer.conv_weight.get_value().shape[1] == runtime.mamba_conv_dim == mixer.conv_dim
    else:
        assert runtime == cfg


def test_sizes_tp_cannot_split_are_value_errors():
    with pytest.raises(ValueError, match="linear_num_key_heads=2"):
        sharding.validate(tiny_hybrid_config(), 4)
    with pytest.raises(ValueError, match="mamba_n_groups=2"):
        recurrent_shards.validate(dataclasses.replace(_mamba_config(2), mamba_n_heads=6), 3)
    with pytest.raises(ValueError, match="mamba_n_heads=4"):
        recurrent_shards.validate(_mamba_config(1), 8)
    recurrent_shards.validate(_mamba_config(2), 4)  # groups replicated: fine
