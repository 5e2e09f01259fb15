"""`kv_cache_dtype` int8 / fp8_e4m3 (`pallas_kernels.kv_quant`) through the engine on tiny-random:
pool layout and sizing, outputs close to the float cache, the Pallas kernels (interpret mode)
reading the same cache as the reference backend, scan_layers, and bad values refused."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.models import tiny_random_config
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.runtime.state import bytes_per_page, init_state, pages_from_memory

SMALL = dict(
    page_size=4,
    num_pages=96,
    max_batch_requests=4,
    max_scheduled_tokens=32,
    max_context_len=96,
    compile_cache_dir=False,
    debug_checks=True,
    lazy_compile="sync",  # only the shapes a run takes compile (same outputs)
)
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (9, 30, 17, 45)]
GREEDY = SamplingParams(max_tokens=12, logprobs=True, prompt_logprobs=True, ignore_eos=True)
# |prompt logprob - the float cache's| on tiny-random (float32; random weights at init scale 2
# make peaky attention), measured over these prompts: int8 max 0.079 / mean 0.021, fp8_e4m3 max
# 0.33 / mean 0.086. (max, mean) bounds:
PROMPT_LOGPROB_TOL = {"int8": (0.15, 0.04), "fp8_e4m3": (0.6, 0.15)}


def _run(kv: str, prompts: list = PROMPTS, params: SamplingParams = GREEDY, **kw) -> tuple[LLM, list]:
    llm = LLM("tiny-random", kv_cache_dtype=kv, **{**SMALL, **kw})
    outs = llm.generate(prompts, params)
    st = llm.stats()
    assert st["free_pages"] == st["total_pages"], "pages leaked"
    return llm, outs


@functools.cache
def _reference(kv: str) -> tuple[LLM, list]:
    """The reference backend's run of the default prompts (shared by tests)."""
    return _run(kv, attention_backend="reference")


@pytest.fixture(scope="module")
def float_run():
    return _reference("auto")[1]


def _prompt_diffs(a, b) -> list[float]:
    return [
        abs(x - y)
        for oa, ob in zip(a, b, strict=True)
        for x, y in zip(oa.prompt_logprobs, ob.prompt_logprobs, strict=True)
        if x is not None
    ]


def _prompt_diff(a, b) -> float:
    return max(_prompt_diffs(a, b))


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_cache_close_to_float(kv, float_run):
    llm, outs = _reference(kv)
    caches = llm.engine.runner.state.caches
    attn = caches[0]
    assert set(attn) == {"k", "v", "k_scale", "v_scale"}
    # the reference backend stores fp8 values and f16 scales as their bits (pool_bits)
    assert attn["k"].dtype == (jnp.int8 if kv == "int8" else jnp.uint8)
    # a scale per head (and per layer under scan_layers' stacked pools)
    assert attn["k_scale"].dtype == jnp.uint16 and attn["k_scale"].shape == attn["k"].shape[:-1]
    assert set(caches[1]) == {"conv"} and caches[1]["conv"].dtype == jnp.float32  # conv: as is
    diffs = _prompt_diffs(outs, float_run)
    top, mean = PROMPT_LOGPROB_TOL[kv]
    assert 0.0 < max(diffs) < top and np.mean(diffs) < mean, (max(diffs), np.mean(diffs))
    # the first tokens come from the prompts' logits: most agree with the float cache (3/4 both)
    same_first = sum(o.token_ids[0] == f.token_ids[0] for o, f in zip(outs, float_run))
    assert same_first >= len(PROMPTS) - 1


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_pallas_reads_the_cache_the_reference_reads(kv, max_logprob_diff):
    """Kernel (interpret mode, int8 / fp8 pools, f16 scales) == reference (bits pools)."""
    few = dict(
        prompts=PROMPTS[1:3],
        max_scheduled_tokens=16,  # one token bucket: the interpret-mode kernels compile once
        params=SamplingParams(max_tokens=6, logprobs=True, prompt_logprobs=True, ignore_eos=True),
    )
    _, ref = _run(kv, attention_backend="reference", **few)
    llm, pal = _run(kv, attention_backend="pallas", **few)
    assert llm.engine.runner.state.caches[0]["k_scale"].dtype == jnp.float16
    assert [o.token_ids for o in pal] == [o.token_ids for o in ref]
    assert max_logprob_diff([o.logprobs for o in pal], [o.logprobs for o in ref]) < 1e-4
    assert _prompt_diff(pal, ref) < 1e-4


def test_scan_layers_quantized_same_tokens(max_logprob_diff):
    _, plain = _reference("int8")
    llm, scanned = _run("int8", attention_backend="reference", scan_layers=True)
    assert llm.engine.runner.state.caches[0]["k_scale"].ndim == 4  # [n, P, B, Hkv]
    assert [o.token_ids for o in scanned] == [o.token_ids for o in plain]
    assert max_logprob_diff([o.logprobs for o in scanned], [o.logprobs for o in plain]) < 1e-4


def _smollm2_like() -> ModelConfig:
    """SmolLM2-135M's attention shape (30 layers, 3 KV heads of 64), no conv layers."""
    return tiny_random_config(
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        hidden_size=576,
        layer_types=("full_attention",) * 30,
        sliding_window=None,
        dtype="bfloat16",
    )


def test_same_memory_holds_about_twice_the_pages():
    cfg = _smollm2_like()
    lg, bs = (0,) * 30, (16,)
    bf16, int8, fp8 = (bytes_per_page(cfg, lg, bs, kv) for kv in ("auto", "int8", "fp8_e4m3"))
    assert bf16 == 30 * 2 * 16 * 3 * 64 * 2
    assert int8 == fp8 == 30 * 2 * 16 * 3 * (64 + 2)  # values + an f16 scale per token-head
    assert bf16 / int8 >= 1.9

    class Device:  # a 1 GiB accelerator
        def memory_stats(self):
            return {"bytes_limit": 1 << 30, "bytes_in_use": 0}

    pages = {
        kv: pages_from_memory(cfg, lg, bs, device=Device(), kv_cache_dtype=kv) for kv in ("auto", "int8")
    }
    assert pages["int8"] >= 1.9 * pages["auto"], pages
    f32 = bytes_per_page(
        tiny_random_config(
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            hidden_size=576,
            sliding_window=None,
            layer_types=("full_attention",) * 30,
        ),
        lg,
        bs,
    )
    assert f32 / int8 >= 3.8
    st = init_state(cfg, lg, bs, (8,), num_pages=5, max_live_requests=2, kv_cache_dtype="int8")
    assert st.caches[0]["k"].dtype == jnp.int8 and st.caches[0]["v_scale"].dtype == jnp.float16
    assert all(not np.asarray(a[0]).any() for c in st.caches for a in c.values())  # null page


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype.*int4"):
        LLM("tiny-random", kv_cache_dtype="int4", **SMALL)


def test_fp8_pages_on_a_gpu_without_fp8_are_refused(monkeypatch):
    from tokenspeed_jax.runtime import backends

    class Device:
        compute_capability = "8.0"  # A100: no fp8 conversions in hardware

    class Mesh:
        devices = np.array([Device()])

    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match=r"fp8_e4m3.*compute capability >= 8\.9.*8\.0"):
        backends.check_fp8_support("fp8_e4m3", "pallas", Mesh())
    backends.check_fp8_support("int8", "pallas", Mesh())  # int8 pages run anywhere
    backends.check_fp8_support("fp8_e4m3", "reference", Mesh())  # XLA converts in software
    Device.compute_capability = "9.0"  # H100 / H200
    backends.check_fp8_support("fp8_e4m3", "pallas", Mesh())
