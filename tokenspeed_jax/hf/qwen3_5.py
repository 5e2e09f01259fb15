"""Qwen3.5 (text) `config.json` -> `ModelConfig` switches.

transformers' `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`); the published checkpoints are the
multimodal `Qwen3_5ForConditionalGeneration` whose language model sits under `text_config` (and
its weights under `model.language_model.`): `text_config_of` takes that part and keeps the
top-level `tie_word_embeddings`, so both load as one text family (the vision tower and the
multi-token-prediction head, `model.visual.*` / `mtp.*`, are skipped by the weight loader).
* layers: Gated DeltaNet "linear_attention" and gated "full_attention" (`layer_types`, else every
  `full_attention_interval`-th layer (default 4) is full attention);
* gated attention: q_proj gives a per-head [query | gate], o *= sigmoid(gate) -> `attn_output_gate`;
* q/k RMSNorm; every RMSNorm is `1 + weight` (zero-centred) except the DeltaNet's gated output norm;
* partial RoPE: `rope_parameters["partial_rotary_factor"]` (default 0.25); the text model's
  multimodal RoPE sections (`mrope_section`) coincide with plain RoPE when all positions are equal,
  which they are for text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

WRAPPERS = ("Qwen3_5ForConditionalGeneration",)
# Keys of rope_parameters that are not about the rotary frequencies of text positions.
ROPE_EXTRA_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def text_config_of(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: `text_config` of a multimodal wrapper, else `hf` itself."""
    if not set(hf.get("architectures") or []) & set(WRAPPERS) or "text_config" not in hf:
        return hf
    text = dict(hf["text_config"])
    text["architectures"] = ["Qwen3_5ForCausalLM"]
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if key in hf and key not in text:
            text[key] = hf[key]
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def qwen3_5_layer_types(hf: Mapping[str, Any], n: int) -> list[str]:
    interval = int(hf.get("full_attention_interval", 4))
    default = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    return list(hf.get("layer_types") or default)


def qwen3_5_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig fields particular to Qwen3.5 (transformers' defaults where config.json is silent)."""
    rope = dict(hf.get("rope_parameters") or {})
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    return dict(
        qk_norm=True,
        attn_output_gate=True,
        norm_weight_offset=1.0,
        partial_rotary_factor=float(factor),
        linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
    )
