"""GGUF blocks kept as stored (`models.block_quant`, `hf.gguf.read_blocks`): the ggml block
layouts decoded against the `gguf` package's own dequantizer, both lowerings of the product
against numpy, and the errors that name what is wrong."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.models import block_quant, quant
from tokenspeed_jax.models.block_quant import block_matmul, check_blocks, dequantize_blocks

gguf = pytest.importorskip("gguf")
from tokenspeed_jax.hf.gguf import read_blocks  # noqa: E402

KINDS = ("Q8_0", "Q4_0", "Q4_1")


def _file_rows(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_read_blocks_equals_the_gguf_dequantizer(kind):
    raw = _file_rows(kind, 6, 96)
    codes, scales, mins = read_blocks(raw, kind)
    assert codes.dtype == np.int8 and codes.shape == (6, 96) and scales.shape == (6, 3)
    assert (mins is not None) == (kind == "Q4_1")
    lo, hi = {"Q8_0": (-128, 127), "Q4_0": (-8, 7), "Q4_1": (0, 15)}[kind]
    assert lo <= codes.min() and codes.max() <= hi
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    got = dequantize_blocks(
        jnp.asarray(codes.T), jnp.asarray(scales.T), None if mins is None else jnp.asarray(mins.T)
    )
    np.testing.assert_allclose(np.asarray(got).T, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("native", [True, False], ids=["native", "jnp"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "lead", [(1,), (2, 3), (block_quant.SPLIT_MAX_ROWS + 1,), (quant.NATIVE_MAX_ROWS + 1,)]
)
def test_block_matmul_is_the_dequantized_product(kind, lead, native, monkeypatch):
    if not native:  # the split (<= SPLIT_MAX_ROWS rows) and float lowerings
        monkeypatch.setattr(block_quant, "use_native", lambda rows=None: False)
    codes, scales, mins = read_blocks(_file_rows(kind, 40, 128, seed=1), kind)
    c, s = jnp.asarray(codes.T), jnp.asarray(scales.T)  # [in, out] layout
    m = None if mins is None else jnp.asarray(mins.T)
    w = np.asarray(dequantize_blocks(c, s, m), np.float64)
    x = np.asarray(jax.random.normal(jax.random.key(2), (*lead, 128))) * 2.0
    got = np.asarray(block_matmul(jnp.asarray(x), c, s, m), np.float64)
    # the split lowering keeps each activation to absmax / 64516 (models.quant.split_rows)
    bound = np.abs(x).max(-1, keepdims=True) / 64516 * np.abs(w).sum(0) + 1e-4
    assert got.shape == (*lead, 40)
    assert (np.abs(got - x @ w) <= bound).all(), np.abs(got - x @ w).max()


def test_bad_blocks_are_named():
    with pytest.raises(ValueError, match="multiple of 32"):
        check_blocks(jnp.zeros((40, 8), jnp.int8), jnp.zeros((1, 8)), None)
    with pytest.raises(ValueError, match="scales.shape"):
        check_blocks(jnp.zeros((64, 8), jnp.int8), jnp.zeros((2, 4)), None)
    with pytest.raises(ValueError, match="mins.shape"):
        check_blocks(jnp.zeros((64, 8), jnp.int8), jnp.zeros((2, 8)), jnp.zeros((8,)))
    with pytest.raises(ValueError, match="Q6_K cannot be kept"):
        read_blocks(np.zeros((2, 210), np.uint8), "Q6_K")
    with pytest.raises(ValueError, match="multiple of 34"):
        read_blocks(np.zeros((2, 35), np.uint8), "Q8_0")


def test_gguf_quantization_needs_a_gguf_file():
    from tokenspeed_jax import LLM

    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM("tiny-random", quantization="gguf")
    with pytest.raises(ValueError, match="one device per replica"):
        LLM("tiny-random", quantization="gguf", tensor_parallel_size=2)


def test_quantize_blocks_is_llama_cpp_q8_0():
    w = np.asarray(jax.random.normal(jax.random.key(3), (96, 24)))
    codes, d = block_quant.quantize_blocks(jnp.asarray(w))
    # the gguf package's Q8_0 of the same rows (its [out, in] layout) decodes to the same blocks
    ref_codes, ref_d, _ = read_blocks(
        gguf.quants.quantize(w.T.astype(np.float32), gguf.GGMLQuantizationType.Q8_0), "Q8_0"
    )
    np.testing.assert_allclose(np.asarray(d).T, ref_d, rtol=1e-3)  # the file rounds d to f16
    assert np.abs(np.asarray(codes).T.astype(int) - ref_codes).max() <= 1
    with pytest.raises(ValueError, match="multiple of 32"):
        block_quant.quantize_blocks(jnp.zeros((40, 8)))


def test_llm_q8_0_quantizes_every_linear_to_blocks():
    from tokenspeed_jax import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, prompt_logprobs=True)
    prompt = [list(range(5, 45))]
    ref = LLM("tiny-random", page_size=16, num_pages=32).generate(prompt, params)[0]
    llm = LLM("tiny-random", page_size=16, num_pages=32, quantization="q8_0")
    leaves = jax.tree_util.tree_leaves_with_path(llm.engine.runner.params)
    codes = [p for p, x in leaves if x.dtype == jnp.int8]
    scales = {jax.tree_util.keystr(p): x.shape for p, x in leaves if "kernel_scale" in str(p)}
    # a scale per 32 inputs; the lm_head per output channel (its blocks would need [G, T, vocab]);
    # scan_layers (the CPU default) stacks a run's layers: one axis more under "runs"
    stacked = lambda k: "['runs']" in k  # noqa: E731
    assert codes and all(len(s) - stacked(k) == (1 if "lm_head" in k else 2) for k, s in scales.items())
    assert any(stacked(k) for k in scales)
    assert any("lm_head" in k for k in scales)
    got = llm.generate(prompt, params)[0]
    d = np.abs(np.asarray(got.prompt_logprobs[1:]) - np.asarray(ref.prompt_logprobs[1:]))
    # random weights amplify errors through the layers (models/test_weight_quant.py): measured
    # max 0.43 / mean 0.068 here, per-channel int8 0.19 / 0.059
    assert d.max() < 0.6 and d.mean() < 0.1, (d.max(), d.mean())


def test_q8_0_blocks_are_closer_than_per_channel_int8():
    from flax import nnx

    from tokenspeed_jax.models.quant import quantize_model
    from tokenspeed_jax.models.registry import build_model, tiny_random_config

    ids = jnp.arange(40, dtype=jnp.int32)
    err = {}
    for mode in ("int8", "q8_0"):
        net = build_model(tiny_random_config(tie_word_embeddings=True), 0)
        ref = np.asarray(net.dense(ids))
        quantize_model(net, mode)
        err[mode] = np.abs(np.asarray(net.dense(ids)) - ref).max()
        if mode == "q8_0":
            assert all(
                m.kernel_scale[...].ndim == 2
                for _, m in nnx.iter_graph(net)
                if getattr(m, "quant_mode", None) == "q8_0"
            )
    assert 0 < err["q8_0"] < err["int8"]  # measured 1.49 against 1.76 (logits up to 31.6)
