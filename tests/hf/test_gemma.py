"""Gemma specifics beyond the shared parity suite (test_hf_parity.py runs gemma2 / gemma3 through
page 4, chunked prefill, prefix hits and retraction vs transformers):

- the soft-caps are live on the tiny Gemma 2 checkpoint (dropping either moves the logprobs far
  more than the parity tolerance), and the Pallas backend (interpret mode on CPU) honours the
  attention soft-cap: its prompt logprobs match transformers like the reference backend's;
- Gemma 3: 5 local : 1 global layers, each with its own RoPE table; a legacy config
  (rope_theta + rope_local_base_freq + sliding_window_pattern, no layer_types) maps the same;
- bidirectional Gemma 3 is refused with a clear error.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenspeed_jax import LLM, SamplingParams  # noqa: E402
from tokenspeed_jax.hf import load_checkpoint, model_config_from_hf  # noqa: E402
from tokenspeed_jax.hf.weights import checkpoint_files, load_model  # noqa: E402

pytestmark = pytest.mark.hf

TOL = 1e-3


def _hf_logprobs(ref, ids) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([list(ids)])).logits[0].float(), -1).numpy()


def test_gemma2_soft_caps_are_live(hf_checkpoints):
    path, ref = hf_checkpoints["gemma2"]
    cfg, model, _ = load_checkpoint(path)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (3.0, 8.0)
    assert cfg.sandwich_norms and cfg.norm_weight_offset == 1.0 and cfg.embed_scale == 8.0
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.sm_scale == pytest.approx(24**-0.5)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 40)
    want = _hf_logprobs(ref, ids)
    for change in ({}, {"attn_logit_softcapping": None}, {"final_logit_softcapping": None}):
        net = model if not change else load_model(dataclasses.replace(cfg, **change), "gemma2",
                                                  checkpoint_files(path))  # fmt: skip
        got = np.asarray(jax.nn.log_softmax(net.dense(jnp.asarray(ids, jnp.int32)), -1))
        delta = np.abs(got - want).max()
        assert delta < 1e-4 if not change else delta > 0.5, (change, delta)


@pytest.mark.parametrize("backend", ["pallas", "reference"])
def test_attention_soft_cap_in_both_backends(hf_checkpoints, backend):
    path, ref = hf_checkpoints["gemma2"]
    llm = LLM(path, page_size=4, num_pages=64, max_batch_requests=2, max_scheduled_tokens=16,
              max_context_len=64, attention_backend=backend)  # fmt: skip
    prompt = np.random.default_rng(4).integers(0, 384, 30).tolist()  # > window 10, two chunks
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    want = _hf_logprobs(ref, prompt)[np.arange(len(prompt) - 1), prompt[1:]]
    delta = np.abs(np.asarray(out.prompt_logprobs[1:], np.float64) - want).max()
    assert delta < TOL, f"{backend}: {delta:.2e}"


def test_gemma3_local_global_layers_and_legacy_config(hf_checkpoints):
    path, _ = hf_checkpoints["gemma3"]
    cfg, model, _ = load_checkpoint(path)
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling["rope_type"]) == (1e6, 100.0, "linear")
    assert cfg.qk_norm and cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    local = np.asarray(model.layers[0].self_attn.inv_freq[...])
    glob = np.asarray(model.layers[5].self_attn.inv_freq[...])
    np.testing.assert_allclose(local, 100.0 ** -(np.arange(0, 16, 2) / 16), rtol=1e-6)
    np.testing.assert_allclose(glob, 1e6 ** -(np.arange(0, 16, 2) / 16) / 8.0, rtol=1e-6)
    legacy = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 384, "hidden_size": 64,
              "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_hidden_layers": 12, "rope_theta": 1e6, "rope_local_base_freq": 100.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 11,
              "query_pre_attn_scalar": 32}  # fmt: skip
    old = model_config_from_hf(legacy)
    assert old.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert (old.rope_theta, old.rope_local_theta, old.rope_scaling) == (
        cfg.rope_theta,
        cfg.rope_local_theta,
        cfg.rope_scaling,
    )
    assert old.tie_word_embeddings and old.hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="bidirectional"):
        model_config_from_hf({**legacy, "use_bidirectional_attention": True})
