"""Random tiny Hugging Face checkpoints of the nine supported families, written by transformers.

Every checkpoint: hidden 64, 2-6 layers, vocab 384, sliding windows of 10-12 tokens, weights
drawn with a larger-than-default std so the logits are peaked, and every 1-D parameter (norm
weights, biases, sinks) perturbed away from its 1 / 0 init so a mis-mapped norm or bias shows.
A small byte-level BPE `tokenizer.json` with a chat template and a generation_config.json with
two eos ids go with each.
"""

from __future__ import annotations

import json
import os

VOCAB = 384
INIT_STD = 0.3
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "You are a helpful assistant. Paged attention keeps the KV cache in fixed-size pages.",
    "The quick brown fox jumps over the lazy dog; sliding windows forget what slid out.",
    "Mixture of experts routes every token to its top-k experts and mixes their outputs.",
    "Short convolutions keep the last few inputs of each channel, like a tiny state.",
] * 4


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, initializer_range=INIT_STD,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    base.update(kw)
    return base


def family_configs():
    """name -> transformers config of each family (imports transformers lazily)."""
    import transformers as tr

    return {
        "llama": tr.LlamaConfig(**_common(
            num_hidden_layers=3, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32})),  # fmt: skip
        "qwen3": tr.Qwen3Config(**_common(
            num_hidden_layers=4, use_sliding_window=True, sliding_window=12,
            layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])),
        "mistral": tr.MistralConfig(**_common(num_hidden_layers=2, sliding_window=10)),
        "lfm2": tr.Lfm2Config(**{k: v for k, v in _common(
            num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
            conv_bias=True, block_auto_adjust_ff_dim=False, norm_eps=1e-5).items() if k != "head_dim"}),
        "gpt_oss": tr.GptOssConfig(**_common(
            num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, sliding_window=12,
            swiglu_limit=1.5,  # small enough that the clamp really fires on these activations
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
        # Soft-caps far below the defaults (50 / 30) so that tanh really bends these logits.
        "gemma2": tr.Gemma2Config(**_common(
            num_hidden_layers=3, sliding_window=10, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        # 5 local : 1 global; local RoPE base 100 vs global 1e6 with linear scaling (as Gemma 3 4B+).
        "gemma3": tr.Gemma3TextConfig(**_common(
            num_hidden_layers=6, sliding_window=11, query_pre_attn_scalar=32,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
        # Gated DeltaNet hybrid: 3 linear-attention layers around one gated full-attention layer,
        # 2 key heads shared by 4 value heads, partial RoPE on a quarter of head_dim.
        "qwen3_5": tr.Qwen3_5TextConfig(**_common(
            num_hidden_layers=4, attention_bias=True,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
        # Mamba2 hybrid: attention at layer 1 only; 8 SSM heads of 16 over 2 B/C groups, state 16.
        "bamba": tr.BambaConfig(**{k: v for k, v in _common(
            num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
            mamba_d_conv=4, mamba_chunk_size=16).items() if k != "head_dim"}),
    }  # fmt: skip


def write_tokenizer(path: str) -> None:
    """tokenizer.json (byte-level BPE + BOS post-processor), tokenizer_config.json, generation config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert [tok.token_to_id(s) for s in specials] == [0, 1, 2, 3, 4]
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        eos = {"__type": "AddedToken", "content": "</s>", "special": True}  # legacy dict form
        json.dump({"bos_token": "<s>", "eos_token": eos, "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)  # fmt: skip
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 0}, f)


def build_checkpoint(name: str, config, path: str, *, max_shard_size: str | None = None):
    """Random model of `config` (seeded), saved with `save_pretrained`; returns the torch model."""
    import torch
    import transformers as tr

    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms (init 1), biases and router bias (init 0), sinks
                p.add_(torch.randn_like(p) * 0.2)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    write_tokenizer(path)
    return model
