"""float32 activations over bf16 weights (`runtime.prepare.wide_activations`): a bf16 model
tiled for the native CPU matmul keeps its residual stream, norms and SwiGLU in float32 (XLA:CPU
runs bf16 elementwise ops through converts), while its products round their inputs to bf16 and
its K/V pages stay bf16."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.native_kernels import need_native
from tokenspeed_jax.models import build_model, tiny_random_config
from tokenspeed_jax.runtime.prepare import prepare, wide_activations

ATTENTION = ("full_attention", "sliding_attention", "full_attention", "full_attention")


def _config(**kw):
    return tiny_random_config(layer_types=ATTENTION, **kw)


@pytest.mark.parametrize(
    "kw,quantization,want",
    [
        (dict(dtype="bfloat16"), None, True),
        (dict(dtype="float32"), None, False),  # nothing to widen
        (dict(dtype="bfloat16"), "int8", False),  # quantized products keep the model dtype
        (dict(dtype="bfloat16", layer_types=("full_attention", "conv")), None, False),  # conv pools
    ],
)
def test_which_models_widen(kw, quantization, want):
    cfg = tiny_random_config(**{"layer_types": ATTENTION, **kw})
    assert wide_activations(cfg, quantization) is want


def test_prepare_widens_a_tiled_bf16_model_and_its_embeddings():
    need_native("block_matmul")
    cfg = _config(dtype="bfloat16")
    prepared = prepare(cfg, build_model(cfg))
    assert prepared.tiled and prepared.activation_dtype == "float32"
    assert prepared.net.embed(jnp.arange(5, dtype=jnp.int32)).dtype == jnp.float32
    untiled = prepare(cfg, build_model(cfg), one_device=False)  # e.g. under a mesh: XLA's dot
    assert untiled.activation_dtype == "bfloat16"
    assert untiled.net.embed(jnp.arange(5, dtype=jnp.int32)).dtype == jnp.bfloat16


def test_wide_activations_are_closer_to_float32_than_a_bf16_stream():
    """The same bf16 weights: logits with float32 activations are nearer the float32 model's
    (the same weights widened) than logits with a bf16 residual stream."""
    need_native("block_matmul")
    cfg16 = _config(dtype="bfloat16")
    ids = jnp.asarray(np.random.default_rng(0).integers(3, cfg16.vocab_size, 48), jnp.int32)
    truth = prepare(_config(dtype="float32"), build_model(_config(dtype="float32"))).net
    wide = prepare(cfg16, build_model(cfg16)).net
    narrow = prepare(cfg16, build_model(cfg16), activation_dtype="bfloat16").net
    # the float32 model with the bf16 model's weights (build_model rounds the same draw)
    for (_, a), (_, b) in zip(sorted(_params(truth).items()), sorted(_params(wide).items()), strict=True):
        a[...] = b[...].astype(a.dtype)
    want = np.asarray(truth.dense(ids))
    err_wide = np.abs(np.asarray(wide.dense(ids)) - want).mean()
    err_narrow = np.abs(np.asarray(narrow.dense(ids)) - want).mean()
    assert np.isfinite(err_wide) and err_wide < 0.8 * err_narrow, (err_wide, err_narrow)


def _params(net):
    from flax import nnx

    return {path: v for path, v in nnx.iter_graph(net) if isinstance(v, nnx.Param)}
