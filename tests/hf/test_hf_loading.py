"""HF loader: config mapping, cache groups, weights (single / sharded / tied / bf16), errors,
tokenizer + chat template vs transformers, RoPE tables and MXFP4 vs transformers, and the dense
forward of every family vs transformers' log-softmax."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scheduler import SchedulerConfig, cache_layout  # noqa: E402
from tests.hf.conftest import FAMILIES  # noqa: E402
from tokenspeed_jax.hf import SUPPORTED_ARCHITECTURES, load_checkpoint, load_config  # noqa: E402
from tokenspeed_jax.hf.mxfp4 import dequantize_mxfp4  # noqa: E402
from tokenspeed_jax.models.rope import rope_parameters  # noqa: E402

pytestmark = pytest.mark.hf


def _hf_logprobs(model, ids) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


# qwen3_5: transformers' own float32 forward is 2.7e-4 from its float64 one on this checkpoint
# (measured; ours is 2.4e-4 from float64), so a 1e-4 bound would test rounding, not the mapping.
DENSE_TOL = {"qwen3_5": 5e-4}


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_forward_matches_transformers(hf_checkpoints, family):
    path, ref = hf_checkpoints[family]
    cfg, model, _ = load_checkpoint(path)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 48)  # longer than every window
    want = _hf_logprobs(ref, ids)
    got = np.asarray(jax.nn.log_softmax(jax.jit(model.dense)(jnp.asarray(ids, jnp.int32)), -1))
    assert np.abs(got - want).max() < DENSE_TOL.get(family, 1e-4)
    assert np.exp(want).max(-1).mean() > 0.1, "logits too flat to make the parity meaningful"


def test_config_mapping_and_cache_groups(hf_checkpoints):
    cfgs = {f: load_config(hf_checkpoints[f][0]) for f in FAMILIES}
    expect = {
        "llama": (("full_attention",) * 3, None),
        "qwen3": (("full_attention", "sliding_attention", "sliding_attention", "full_attention"), 12),
        "mistral": (("sliding_attention",) * 2, 10),
        "lfm2": (("conv", "conv", "full_attention", "conv"), None),
        "gpt_oss": (("sliding_attention", "full_attention", "sliding_attention"), 12),
    }
    for family, (types, window) in expect.items():
        cfg = cfgs[family]
        assert (cfg.layer_types, cfg.sliding_window) == (types, window), family
        assert cfg.eos_token_id == (2, 4)  # generation_config.json wins over config.json's 2
        assert cfg.max_position_embeddings == 512
        layout = cache_layout(SchedulerConfig(num_pages=64, page_size=4), cfg)
        specs = layout.scheduler_config.groups
        for layer, g in enumerate(layout.layer_groups):
            spec, kind = specs[g], cfg.layer_types[layer]
            if kind == "full_attention":
                assert spec.retention == "full_history"
            elif kind == "sliding_attention":
                assert (spec.sliding_window_tokens, spec.live_tail_alloc) == (window, False)
            else:  # conv: live-tail group, window = conv kernel
                assert (spec.sliding_window_tokens, spec.live_tail_alloc) == (cfg.conv_L_cache, True)
    llama, qwen, lfm, oss = cfgs["llama"], cfgs["qwen3"], cfgs["lfm2"], cfgs["gpt_oss"]
    assert llama.tie_word_embeddings and llama.attention_bias and llama.o_proj_bias and llama.mlp_bias
    assert llama.rope_scaling["rope_type"] == "llama3"
    assert qwen.qk_norm and not qwen.tie_word_embeddings
    assert lfm.qk_norm and lfm.conv_bias and lfm.conv_L_cache == 3 and lfm.tie_word_embeddings
    assert oss.attention_sinks and oss.attention_bias and oss.o_proj_bias
    assert (oss.num_local_experts, oss.num_experts_per_tok, oss.swiglu_limit) == (4, 2, 1.5)
    assert oss.rope_scaling["rope_type"] == "yarn"


def test_qwen3_5_config_and_multimodal_checkpoint(hf_checkpoints, tmp_path):
    """Qwen3.5's switches, and its published layout: `Qwen3_5ForConditionalGeneration` with the
    language model under `text_config` / `model.language_model.`, a vision tower and an MTP head
    (skipped), loads to the same model as the text-only checkpoint."""
    from safetensors.numpy import load_file, save_file

    src, ref = hf_checkpoints["qwen3_5"]
    cfg = load_config(src)
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    assert (cfg.partial_rotary_factor, cfg.rotary_dim, cfg.rope_scaling) == (0.25, 4, None)
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.norm_weight_offset == 1.0
    assert cfg.attention_bias and cfg.o_proj_bias
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_conv_dim) == (2, 4, 64)
    layout = cache_layout(SchedulerConfig(num_pages=64, page_size=4), cfg)
    kinds = [layout.scheduler_config.groups[g].family for g in layout.layer_groups]
    assert kinds == ["state", "history", "state", "state"]
    dst = tmp_path / "wrapped"
    shutil.copytree(src, dst)
    text = json.loads((dst / "config.json").read_text())
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "tie_word_embeddings": False, "text_config": {**text, "model_type": "qwen3_5_text"},
               "vision_config": {"depth": 1}}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(wrapper))
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in load_file(str(dst / "model.safetensors")).items()
    }
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((3, 3), np.float32)
    save_file(tensors, str(dst / "model.safetensors"))
    assert load_config(str(dst)) == cfg
    _, model, _ = load_checkpoint(str(dst))
    conv = ref.model.layers[0].linear_attn.conv1d.weight.detach().numpy()  # [C, 1, K]
    np.testing.assert_array_equal(np.asarray(model.layers[0].linear_attn.conv_weight[...]), conv[:, 0].T)
    ids = jnp.arange(40, dtype=jnp.int32) % 384
    np.testing.assert_array_equal(
        np.asarray(jax.jit(model.dense)(ids)), np.asarray(jax.jit(load_checkpoint(src)[1].dense)(ids))
    )


def test_bamba_config_and_mamba_weights(hf_checkpoints):
    path, ref = hf_checkpoints["bamba"]
    cfg, model, _ = load_checkpoint(path)
    assert cfg.layer_types == ("mamba", "full_attention", "mamba", "mamba")
    assert (cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state) == (8, 16, 2, 16)
    assert cfg.mamba_dt_limit == (0.0, float("inf"))  # config.json spells it {"__float__": "Infinity"}
    assert (cfg.rotary_dim, cfg.mamba_conv_dim, cfg.rms_norm_eps) == (8, 192, 1e-5)
    layout = cache_layout(SchedulerConfig(num_pages=64, page_size=4), cfg)
    assert [layout.scheduler_config.groups[g].family for g in layout.layer_groups] == ["state", "history"] + [
        "state"
    ] * 2
    mixer, want = model.layers[2].mamba, ref.model.layers[2].mamba
    np.testing.assert_array_equal(np.asarray(mixer.conv_bias[...]), want.conv1d.bias.detach().numpy())
    np.testing.assert_array_equal(np.asarray(mixer.D[...]), want.D.detach().numpy())
    norm = ref.model.layers[3].pre_ff_layernorm.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.layers[3].post_attention_layernorm.weight[...]), norm)


def test_sharded_tied_and_bf16_loading(hf_checkpoints, tmp_path):
    qwen_dir = hf_checkpoints["qwen3"][0]
    assert os.path.isfile(os.path.join(qwen_dir, "model.safetensors.index.json"))
    ref = hf_checkpoints["qwen3"][1]
    _, model, _ = load_checkpoint(qwen_dir)
    # Spot checks of the mapping itself: transposed projection, q/k norms, untied head.
    layer = model.layers[1].self_attn
    np.testing.assert_array_equal(
        np.asarray(layer.k_proj.kernel[...]), ref.model.layers[1].self_attn.k_proj.weight.detach().numpy().T
    )
    np.testing.assert_array_equal(
        np.asarray(layer.k_norm.weight[...]), ref.model.layers[1].self_attn.k_norm.weight.detach().numpy()
    )
    head = ref.lm_head.weight.detach().numpy().T
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), head)
    _, llama, _ = load_checkpoint(hf_checkpoints["llama"][0])
    assert llama.lm_head is None  # tied: logits use the embedding table
    cfg16, m16, _ = load_checkpoint(hf_checkpoints["lfm2"][0], dtype="bfloat16")
    assert cfg16.dtype == "bfloat16" and m16.embed_tokens[...].dtype == jnp.bfloat16
    assert m16.layers[0].conv.conv_weight[...].shape == (3, 64)
    # A shard listed in the index but absent is a clear error.
    broken = tmp_path / "broken"
    shutil.copytree(qwen_dir, broken)
    first = sorted(p for p in os.listdir(broken) if p.endswith(".safetensors"))[0]
    os.remove(broken / first)
    with pytest.raises(ValueError, match="missing"):
        load_checkpoint(str(broken))


def test_errors_name_what_is_supported_or_missing(hf_checkpoints, tmp_path):
    src = hf_checkpoints["mistral"][0]
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(str(tmp_path))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*" + ".*".join(SUPPORTED_ARCHITECTURES)):
        load_checkpoint(str(bad))
    (bad / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "longrope"}}))
    with pytest.raises(ValueError, match="longrope"):
        load_checkpoint(str(bad))
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    with pytest.raises(ValueError, match="shape"):
        load_checkpoint(str(bad))
    (bad / "config.json").write_text(json.dumps(cfg))
    os.remove(bad / "model.safetensors")
    with pytest.raises(ValueError, match="safetensors"):
        load_checkpoint(str(bad))


def test_tokenizer_and_chat_template_match_transformers(hf_checkpoints):
    path = hf_checkpoints["llama"][0]
    _, _, tok = load_checkpoint(path)
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    text = "You are a helpful assistant. Über-paged attention! 123"
    ids = tok.encode(text)
    assert ids == ref(text)["input_ids"] and ids[0] == tok.bos_token_id == 1
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.eos_token_id == 2
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == want
    assert want.startswith("<s><|im_start|>system\nBe brief.<|im_end|>\n")


def test_rope_tables_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32}),
        ("yarn", {"factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 64}),
        ("yarn", {"factor": 4.0, "original_max_position_embeddings": 128}),
        ("linear", {"factor": 2.0}),
    ]  # fmt: skip
    for kind, params in cases:
        rope = {"rope_type": kind, "rope_theta": 10000.0, **params}
        cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                       max_position_embeddings=512, rope_parameters=rope)  # fmt: skip
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        got, factor = rope_parameters(16, 10000.0, rope, 512)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
        assert factor == pytest.approx(want_factor)
        assert np.abs(got - rope_parameters(16, 10000.0, None)[0]).max() > 1e-3  # really scaled


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 6, 2, 16), dtype=np.uint8)  # [E, rows, groups, 16 bytes]
    scales = rng.integers(120, 134, (2, 6, 2), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32)
    got = dequantize_mxfp4(jnp.asarray(blocks), jnp.asarray(scales))
    assert got.shape == (2, 64, 6)
    np.testing.assert_array_equal(np.asarray(got), want.numpy())


def test_mxfp4_packed_experts_load_dequantized(hf_checkpoints, tmp_path):
    """A GPT-OSS checkpoint with experts stored as published (MXFP4 *_blocks / *_scales)."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dst = tmp_path / "mxfp4"
    shutil.copytree(hf_checkpoints["gpt_oss"][0], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    rng = np.random.default_rng(0)
    e, h, i = 4, 64, 96
    packed = {}
    for layer in range(3):
        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            del tensors[key]
            blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 130, (e, rows, cols // 32), dtype=np.uint8)
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            packed[(layer, name)] = (blocks, scales)
    save_file(tensors, str(dst / "model.safetensors"))
    _, model, _ = load_checkpoint(str(dst))

    def dequant(layer, name):
        blocks, scales = packed[(layer, name)]
        blocks, scales = torch.tensor(blocks), torch.tensor(scales)
        return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()

    for layer in range(3):
        experts = model.layers[layer].mlp.experts
        gate_up = dequant(layer, "gate_up_proj")  # [E, H, 2I], gate/up interleaved
        np.testing.assert_array_equal(np.asarray(experts.gate_proj[...]), gate_up[..., 0::2])
        np.testing.assert_array_equal(np.asarray(experts.up_proj[...]), gate_up[..., 1::2])
        np.testing.assert_array_equal(np.asarray(experts.down_proj[...]), dequant(layer, "down_proj"))


def test_published_style_config_json_mapping():
    """config.json as the Hub ships them (transformers 4.x keys), no weights needed."""
    from tokenspeed_jax.hf.config import model_config_from_hf

    lfm2 = model_config_from_hf({
        "architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": True, "block_ff_dim": 12288,
        "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "conv_L_cache": 3, "conv_bias": False,
        "eos_token_id": 7, "full_attn_idxs": [2, 5], "hidden_size": 2048, "max_position_embeddings": 128000,
        "norm_eps": 1e-05, "num_attention_heads": 32, "num_heads": 32, "num_hidden_layers": 6,
        "num_key_value_heads": 8, "rope_theta": 1000000.0, "tie_embedding": True, "vocab_size": 65536,
        "torch_dtype": "bfloat16"}, dtype="auto")  # fmt: skip
    assert lfm2.layer_types == ("conv", "conv", "full_attention", "conv", "conv", "full_attention")
    assert (lfm2.intermediate_size, lfm2.head_dim, lfm2.dtype) == (8192, 64, "bfloat16")
    assert lfm2.tie_word_embeddings and lfm2.rope_theta == 1e6 and lfm2.eos_token_id == 7
    llama = model_config_from_hf({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 1000,
        "rope_theta": 500000.0, "eos_token_id": [128001, 128008, 128009], "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}})  # fmt: skip
    assert llama.rope_theta == 500000.0 and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.eos_token_id == (128001, 128008, 128009) and llama.head_dim == 64
    oss = model_config_from_hf({
        "architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880,
        "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 4,
        "num_local_experts": 32, "experts_per_token": 4, "num_experts_per_tok": 4, "vocab_size": 201088,
        "sliding_window": 128, "rope_theta": 150000, "max_position_embeddings": 131072,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "swiglu_limit": 7.0, "quantization_config": {"quant_method": "mxfp4"}})  # fmt: skip
    assert oss.layer_types == ("sliding_attention", "full_attention") * 2 and oss.sliding_window == 128
    assert oss.rope_scaling["truncate"] is False and oss.num_local_experts == 32
    qwen = model_config_from_hf({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
        "head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 3,
        "vocab_size": 151936, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
        "rope_theta": 1000000, "tie_word_embeddings": True})  # fmt: skip
    assert qwen.layer_types == ("full_attention",) * 3 and qwen.sliding_window is None
    mistral = model_config_from_hf({
        "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 32768,
        "sliding_window": None, "rope_theta": 1000000.0})  # fmt: skip
    assert mistral.layer_types == ("full_attention",) * 2 and mistral.head_dim == 128
