"""q/k/v and gate/up fused into one Linear each (issue 46: the accelerator default), laid out for
1 or 2 tensor-parallel shards: the same logits as the separate products, float and int8."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.models import registry
from tokenspeed_jax.models.layers import Linear, fuse_linears, split_fused
from tokenspeed_jax.models.quant import quantize_model


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_fused_model_gives_the_same_logits(shards, quantization):
    cfg, net = registry.load_builtin("tiny-random", seed=3)
    if quantization is not None:
        quantize_model(net, quantization)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, 24), jnp.int32)
    want = np.asarray(net.dense(ids))
    fused = fuse_linears(net, shards)
    # every attention layer's q/k/v and every layer's MLP (conv layers have one too)
    assert fused == sum(t != "conv" for t in cfg.layer_types) + len(cfg.layer_types)
    layer = next(i for i, t in enumerate(cfg.layer_types) if t != "conv")
    attn = net.layers[layer].self_attn
    assert attn.q_proj is None and attn.qkv_proj is not None and attn.fused_shards == shards
    np.testing.assert_allclose(np.asarray(net.dense(ids)), want, atol=2e-5, rtol=1e-5)


def test_interleaved_columns_split_back():
    """absorb with 2 shards lays [a_0 b_0 | a_1 b_1]; split_fused reads a and b back."""
    cfg = registry.tiny_random_config()
    rngs = nnx.Rngs(0)
    a, b = Linear(8, 6, bias=True, cfg=cfg, rngs=rngs), Linear(8, 4, bias=True, cfg=cfg, rngs=rngs)
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 8))
    want = [np.asarray(a(x)), np.asarray(b(x))]
    assert a.absorb([b], shards=2)
    w = np.asarray(a.kernel.get_value())
    assert w.shape == (8, 10)
    got = split_fused(a(x), (6, 4), 2)
    for g, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w_, atol=1e-6)
    # a width the shards do not divide is refused, nothing changed
    c, d = Linear(8, 3, bias=False, cfg=cfg, rngs=rngs), Linear(8, 3, bias=False, cfg=cfg, rngs=rngs)
    assert not c.absorb([d], shards=2) and c.kernel.get_value().shape == (8, 3)
