"""Tile-major weights for the native CPU kernel (`models.layers.tile_linears`): which Linears and
tables take the layout, the model's outputs unchanged by it (same float32 products, another
summation order), and the runner laying out a one-device CPU model that way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.native_kernels import need_native
from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.models import build_model, tiny_random_config
from tokenspeed_jax.models.layers import Linear, tile_linears
from tokenspeed_jax.models.quant import quantize_model

IDS = jnp.asarray(np.random.default_rng(0).integers(0, 256, 24), jnp.int32)


def _linears(net) -> list[Linear]:
    return [m for _, m in nnx.iter_graph(net) if isinstance(m, Linear)]


@pytest.mark.parametrize(
    "dtype,mode", [("bfloat16", None), ("float32", None), ("bfloat16", "int8"), ("bfloat16", "q8_0")]
)
def test_tiling_keeps_the_outputs(dtype, mode):
    """float32 / bf16 weights, int8 weight-only and Q8_0 blocks: every Linear and the tied table
    (vocab 256, a multiple of 16) re-laid; logits equal to rounding."""
    net = build_model(tiny_random_config(vocab_size=256, dtype=dtype, tie_word_embeddings=True), 0)
    if mode is not None:
        quantize_model(net, mode)
    before = np.asarray(net.dense(IDS), np.float32)
    linears = _linears(net)
    assert tile_linears(net) == len(linears) + 1
    assert all(m.kernel[...].ndim == 3 and m.kernel[...].shape[2] == 16 for m in linears)
    assert net.embed_tokens[...].shape == (16, 64, 16)
    # then q / k / v and gate / up fused: one product each (64 + 32 + 32 and 128 + 128 columns)
    attn, mlp = net.layers[0].self_attn, net.layers[0].mlp
    assert attn.q_proj is None and attn.qkv_proj.kernel[...].shape == (8, 64, 16)
    assert mlp.gate_proj is None and mlp.gate_up_proj.kernel[...].shape == (16, 64, 16)
    if mode is not None:  # scales follow their columns
        assert attn.qkv_proj.kernel_scale[...].shape[-1] == 128
    assert len(_linears(net)) == len(linears) - 2 * 3 - 4  # 3 attention + 4 MLP layers
    after = np.asarray(net.dense(IDS), np.float32)
    # measured: float32 and bf16 identical (K = 64 summed in the same order); int8 / q8_0 max 0.0625 of
    # logits up to 34 (their tied table moves from XLA's integer dot to the kernel, rounded to
    # bf16)
    np.testing.assert_allclose(after, before, atol=0.01 * np.abs(before).max())
    assert tile_linears(net) == 0  # idempotent: a tiled kernel is not [in, out] any more


def test_w8a8_and_odd_widths_stay_in_kn_layout():
    """w8a8 stays on XLA's integer dot; a vocabulary of 260 cannot be cut in 16-column tiles."""
    net = build_model(tiny_random_config(), 0)  # untied: lm_head [64, 260]
    n = len(_linears(net))
    assert tile_linears(net) == n - 1  # every Linear but the lm_head
    assert net.lm_head.kernel[...].shape == (64, 260)
    net = build_model(tiny_random_config(dtype="bfloat16", tie_word_embeddings=True), 0)
    n = len(_linears(net))
    assert tile_linears(net) == n  # not the 260-row table
    assert net.embed_tokens[...].shape == (260, 64)
    net = build_model(tiny_random_config(vocab_size=256), 0)
    quantize_model(net, "w8a8")
    assert tile_linears(net) == 0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's native kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_tiles_a_one_device_model(dtype):
    need_native("block_matmul")  # fails in CI ($TOKENSPEED_JAX_REQUIRE_NATIVE) if unbuilt
    llm = LLM(
        "tiny-random",
        dtype=dtype,
        page_size=4,
        num_pages=64,
        max_batch_requests=2,
        max_scheduled_tokens=32,
        max_context_len=64,
        compile_cache_dir=False,
    )
    kernels = {
        jax.tree_util.keystr(p): x
        for p, x in jax.tree_util.tree_leaves_with_path(llm.engine.runner.params)
        if "kernel" in jax.tree_util.keystr(p)
    }
    # all but the lm_head [64, 260]; scan_layers (the CPU default) stacks a run's layers: one
    # axis more under "runs"
    stacked = {k: "['runs']" in k for k in kernels}
    flat = [k for k, x in kernels.items() if x.ndim - stacked[k] == 2]
    assert flat == ["['shell']['lm_head']['kernel'].value"]
    assert sum(x.shape[0] if stacked[k] else 1 for k, x in kernels.items()) > 12
    out = llm.generate([[1, 5, 9, 14]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    st = llm.stats()
    assert st["free_pages"] == st["total_pages"]
