"""int8 weights (`models.quant`): the per-channel quantizer, both matmul modes against numpy,
and `LLM(quantization=...)` on tiny-random (int8 kernels, a tied table, outputs close to the
float model, bad values refused)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.native_kernels import need_native
from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.models import build_model, quant, tiny_random_config
from tokenspeed_jax.models.layers import Linear
from tokenspeed_jax.models.quant import (
    NATIVE_MAX_ROWS,
    SPLIT_MAX_ROWS,
    qmatmul,
    quantize_columns,
    quantize_model,
)

SMALL = dict(
    page_size=4,
    num_pages=96,
    max_batch_requests=4,
    max_scheduled_tokens=16,  # token buckets 1 and 16: one compile fewer per LLM than 32
    max_context_len=96,
    attention_backend="reference",
    lazy_compile="sync",  # only the shapes a run takes compile (same outputs)
    # the session's compile cache stays on (tests/conftest.py): LLMs of one mode share programs
)
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (9, 30, 17)]
PARAMS = SamplingParams(max_tokens=8, prompt_logprobs=True, ignore_eos=True)
# |prompt logprob - the float model's| on tiny-random (float32), measured over these prompts:
# int8 max 0.15 / mean 0.047, w8a8 max 0.33 / mean 0.071. (max, mean) bounds:
TOL = {"int8": (0.4, 0.1), "w8a8": (0.6, 0.15)}


def test_quantize_columns_error_is_half_a_step():
    w = jax.random.normal(jax.random.key(0), (96, 40)) * jnp.linspace(0.01, 3.0, 40)
    q, s = quantize_columns(w)
    assert q.dtype == jnp.int8 and s.shape == (40,) and s.dtype == jnp.float32
    err = np.abs(np.asarray(q, np.float32) * np.asarray(s) - np.asarray(w))
    assert (err <= np.asarray(s) * 0.5 + 1e-7).all()
    assert np.abs(np.asarray(q)).max() == 127  # every column uses its whole range


@pytest.fixture(params=["native", "jnp"])
def lowering(request, monkeypatch):
    """The int8 product through the native block kernel (where it builds) or the jnp ones."""
    if request.param == "jnp":
        monkeypatch.setattr(quant, "use_native", lambda rows=None: False)
    elif jax.default_backend() != "cpu":
        pytest.skip("the native block kernel is XLA:CPU's")
    else:
        need_native("block_matmul")  # fails in CI ($TOKENSPEED_JAX_REQUIRE_NATIVE) if unbuilt
    return request.param


@pytest.mark.parametrize("lead", [(5,), (2, 3), (1,), (), (200,)])  # 200 rows: the float lowering
def test_qmatmul_modes_match_numpy(lead, lowering):
    x = np.asarray(jax.random.normal(jax.random.key(1), (*lead, 96))) * 3.0
    q, s = quantize_columns(jax.random.normal(jax.random.key(2), (96, 40)))
    qn, sn = np.asarray(q, np.float64), np.asarray(s, np.float64)
    want = x @ (qn * sn)  # weight-only: the dequantized weights, activations untouched
    # the split lowering's bound: each activation kept to absmax / (2 * 254 * 127)
    bound = np.abs(x).max(-1, keepdims=True) / 64516 * (np.abs(qn) * sn).sum(0) + 1e-5
    for transposed in (False, True):  # the transposed form (a tied table [N, K]): same product
        got = np.asarray(
            qmatmul(jnp.asarray(x), q.T if transposed else q, s, "int8", q_transposed=transposed)
        )
        assert got.shape == (*lead, 40)
        assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()
    sx = np.abs(x).max(-1, keepdims=True) / 127  # w8a8: int8 activations per token, exact dot
    xq = np.round(x / sx)
    np.testing.assert_allclose(
        np.asarray(qmatmul(jnp.asarray(x), q, s, "w8a8")), (xq @ qn) * sx * sn, rtol=1e-5, atol=1e-5
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's lowering")
@pytest.mark.parametrize("rows", [1, 16, SPLIT_MAX_ROWS])
def test_int8_weights_stay_int8_in_small_steps(rows, lowering):
    """Up to SPLIT_MAX_ROWS rows (NATIVE_MAX_ROWS with the native kernel) the weight-only
    product reads the int8 matrix itself: the compiled step holds no float copy of it (the
    float lowering converts it)."""
    last = NATIVE_MAX_ROWS if lowering == "native" else SPLIT_MAX_ROWS
    q, s = jnp.ones((576, 1536), jnp.int8), jnp.ones((1536,), jnp.float32)

    def float_weights(n: int) -> int:
        xn = jnp.ones((n, 576), jnp.float32)
        hlo = jax.jit(lambda a, b, c: qmatmul(a, b, c, "int8")).lower(xn, q, s).compile()
        return hlo.as_text().count("f32[576,1536]")

    assert float_weights(rows) == 0 and float_weights(last) == 0
    assert float_weights(last + 1) > 0  # prefill-sized: the float lowering


def test_quantize_model_covers_every_linear_and_a_tied_table():
    net = build_model(tiny_random_config(tie_word_embeddings=True), 0)
    ids = jnp.arange(20, dtype=jnp.int32)
    ref = np.asarray(net.dense(ids))
    linears = [m for _, m in nnx.iter_graph(net) if isinstance(m, Linear)]
    assert quantize_model(net, "int8") == len(linears) + 1  # + the tied embedding table
    assert all(m.kernel[...].dtype == jnp.int8 and m.kernel_scale is not None for m in linears)
    assert net.embed_tokens[...].dtype == jnp.int8 and net.embed_scale_q[...].shape == (260,)
    got = np.asarray(net.dense(ids))
    # random weights at init scale 2 amplify through the layers: measured 1.76 of logits up to 31.6
    assert 0 < np.abs(got - ref).max() < 0.1 * np.abs(ref).max()
    assert quantize_model(net, "int8") == 0  # idempotent: nothing left in float


@pytest.fixture(scope="module")
def float_outputs():
    return LLM("tiny-random", **SMALL).generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
def test_llm_quantized_weights_close_to_float(mode, float_outputs):
    llm = LLM("tiny-random", quantization=mode, **SMALL)
    kernels = {
        jax.tree_util.keystr(p): x
        for p, x in jax.tree_util.tree_leaves_with_path(llm.engine.runner.params)
        if "kernel" in jax.tree_util.keystr(p)
    }
    assert kernels and all(
        x.dtype == (jnp.float32 if "scale" in k else jnp.int8) for k, x in kernels.items()
    ), {k: x.dtype for k, x in kernels.items()}
    outs = llm.generate(PROMPTS, PARAMS)
    diffs = [
        abs(a - b)
        for o, f in zip(outs, float_outputs, strict=True)
        for a, b in zip(o.prompt_logprobs, f.prompt_logprobs, strict=True)
        if a is not None
    ]
    top, mean = TOL[mode]
    assert 0 < max(diffs) < top and np.mean(diffs) < mean, (max(diffs), np.mean(diffs))
    st = llm.stats()
    assert st["free_pages"] == st["total_pages"]


def test_bad_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization.*int4"):
        LLM("tiny-random", quantization="int4", **SMALL)


def test_int8_and_w8a8_steps_are_distinct_cached_programs(tmp_path):
    """The two modes have the same parameter shapes and dtypes; the executable store must
    still key them apart (a w8a8 start once loaded the int8 executables)."""
    from tokenspeed_jax.runtime import compile_cache

    cached = {**SMALL, "compile_cache_dir": str(tmp_path)}
    try:
        int8 = LLM("tiny-random", quantization="int8", **cached).generate(PROMPTS[:1], PARAMS)
        w8a8 = LLM("tiny-random", quantization="w8a8", **cached).generate(PROMPTS[:1], PARAMS)
    finally:
        compile_cache.enable(None)  # back to the session's cache dir
    fresh = LLM("tiny-random", quantization="w8a8", **SMALL).generate(PROMPTS[:1], PARAMS)
    assert w8a8[0].prompt_logprobs == fresh[0].prompt_logprobs
    assert w8a8[0].prompt_logprobs != int8[0].prompt_logprobs
