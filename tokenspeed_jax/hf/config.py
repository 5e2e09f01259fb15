"""Hugging Face `config.json` -> `ModelConfig`, per supported architecture.

Reads both config generations: transformers >= 5 writes `rope_parameters` (with `rope_theta`
inside), older checkpoints write `rope_theta` + `rope_scaling`. Family rules mirror the
transformers configuration classes (defaults included, since a config.json may omit them):
* Llama: all layers full attention; `attention_bias` puts biases on q/k/v AND o_proj.
* Qwen3: q/k RMSNorm over head_dim; sliding layers only when `use_sliding_window` (layer_types
  given, or layers >= `max_window_layers` slide).
* Mistral: `sliding_window` (when not null) applies to every layer.
* LFM2: `layer_types` with "conv" / "full_attention" (or legacy `full_attn_idxs`), conv kernel
  `conv_L_cache`, q/k layernorm, `norm_eps`, tied embeddings (`tie_embedding`), FFN width from
  `block_ff_dim` / `intermediate_size` with the `block_auto_adjust_ff_dim` rule.
* GPT-OSS: alternating sliding/full (`layer_types`), attention sinks, q/k/v/o biases, MoE with
  clamped SwiGLU, YaRN RoPE (its default when the config has none).
* Qwen3.5 (text, and the text part of the multimodal checkpoints): see `hf/qwen3_5.py` (Gated
  DeltaNet layers, gated attention, partial RoPE).
* Bamba: see `hf/bamba.py` (Mamba2 layers, partial RoPE).
* Gemma 2 / Gemma 3 (text): see `hf/gemma.py` (soft-caps, sandwich norms, GeGLU, local RoPE).
Sliding windows: transformers masks key j for query i unless `i - W < j <= i` (the query sees W
tokens including itself, and its sliding caches keep W - 1 past tokens); our kernels read
`[n - W + 1, n]`, the same set, so `sliding_window` is used as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenspeed_jax.hf.bamba import bamba_kwargs, bamba_layer_types
from tokenspeed_jax.hf.qwen3_5 import ROPE_EXTRA_KEYS, qwen3_5_kwargs, qwen3_5_layer_types, text_config_of
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.rope import SUPPORTED_ROPE_TYPES, rope_type_of

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Lfm2ForCausalLM": "lfm2",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its text_config (hf/qwen3_5.py)
    "BambaForCausalLM": "bamba",
}
DTYPES = ("float32", "bfloat16", "float16")
# transformers' per-family default rope_theta (used when config.json has none).
_DEFAULT_THETA = {
    "llama": 10000.0,
    "qwen3": 10000.0,
    "mistral": 10000.0,
    "lfm2": 1e6,
    "gpt_oss": 150000.0,
    "gemma2": 10000.0,
    "gemma3": 1e6,
    "qwen3_5": 10000.0,
    "bamba": 10000.0,
}
_GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def family_of(hf: Mapping[str, Any]) -> str:
    """Our family name for the config's `architectures[0]`; ValueError if unsupported."""
    archs = hf.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not archs:
        raise ValueError(f"config.json has no 'architectures' entry (supported: {supported})")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    raise ValueError(f"unsupported architecture {archs[0]!r} (supported: {supported})")


def resolve_dtype(dtype: str, hf: Mapping[str, Any]) -> str:
    """ "auto" -> the checkpoint's own dtype (`dtype` / legacy `torch_dtype`), else validated."""
    if dtype == "auto":
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {dtype!r}")
    return dtype


def _rope(hf: Mapping[str, Any], family: str) -> tuple[float, dict | None]:
    params = dict(hf.get("rope_parameters") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    merged = {**(hf.get("rope_scaling") or {}), **params}
    if not merged and family == "gpt_oss":
        merged = dict(_GPT_OSS_DEFAULT_ROPE)
    theta = merged.pop("rope_theta", None) or hf.get("rope_theta") or _DEFAULT_THETA[family]
    partial_ok = family in ("qwen3_5", "bamba")  # partial rotary -> ModelConfig (hf/qwen3_5.py, bamba.py)
    if partial_ok:
        for key in ROPE_EXTRA_KEYS:
            merged.pop(key, None)
    kind = rope_type_of(merged)
    if kind not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope type {kind!r} is not supported (supported: {supported})")
    if kind in ("llama3", "yarn") and merged.get("original_max_position_embeddings") is None:
        orig = hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        merged["original_max_position_embeddings"] = orig
    if not partial_ok and merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    merged["rope_type"] = kind
    return float(theta), (None if kind == "default" else merged)


def _lfm2_ffn_width(hf: Mapping[str, Any]) -> int:
    width = int(hf.get("block_ff_dim") or hf.get("intermediate_size") or 12288)
    if hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(hf.get("block_multiple_of", 256))
            width = int(multiplier * width)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def _layer_types(hf: Mapping[str, Any], family: str, n: int) -> tuple[tuple[str, ...], int | None]:
    window = hf.get("sliding_window")
    given = hf.get("layer_types")
    if family == "llama":
        return ("full_attention",) * n, None
    if family in ("gemma2", "gemma3") and not given:
        from tokenspeed_jax.hf.gemma import gemma_layer_types

        given = gemma_layer_types(hf, family, n)
    if family == "mistral":
        return (("sliding_attention" if window else "full_attention"),) * n, window or None
    if family == "qwen3":
        window = window if hf.get("use_sliding_window", False) else None
        types = given or [
            "sliding_attention" if window and i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(n)
        ]
    elif family == "qwen3_5":
        types = qwen3_5_layer_types(hf, n)
    elif family == "bamba":
        types = bamba_layer_types(hf, n)
    elif family == "lfm2":
        attn = hf.get("full_attn_idxs")
        attn = range(n) if attn is None else attn
        types = given or ["full_attention" if i in attn else "conv" for i in range(n)]
    else:  # gpt_oss
        types = given or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    types = [t if (t != "sliding_attention" or window) else "full_attention" for t in types]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers is {n}")
    return tuple(types), (window if "sliding_attention" in types else None)


def _eos(hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> int | tuple[int, ...] | None:
    eos = (generation or {}).get("eos_token_id", hf.get("eos_token_id"))
    if isinstance(eos, (list, tuple)):
        return tuple(int(e) for e in eos) if len(eos) != 1 else int(eos[0])
    return None if eos is None else int(eos)


def model_config_from_hf(
    hf: Mapping[str, Any], *, dtype: str = "float32", generation_config: Mapping[str, Any] | None = None
) -> ModelConfig:
    """Builds our `ModelConfig` from a parsed config.json (and generation_config.json, whose
    `eos_token_id` wins over config.json's). Raises ValueError for anything unsupported."""
    hf = text_config_of(hf)
    family = family_of(hf)
    if family in ("gemma2", "gemma3"):
        from tokenspeed_jax.hf.gemma import gemma_defaults

        hf = {**gemma_defaults(family, hf), **hf}
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    act = "silu" if act == "swish" else act
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)")
    hidden = int(hf["hidden_size"])
    heads_given = hf.get("num_attention_heads") or hf.get("num_heads")
    if heads_given is None:
        raise ValueError("config.json gives neither num_attention_heads nor num_heads")
    heads = int(heads_given)
    n = int(hf["num_hidden_layers"])
    layer_types, window = _layer_types(hf, family, n)
    if family == "gemma3":
        from tokenspeed_jax.hf.gemma import gemma3_rope

        (theta, rope_scaling), local_rope = gemma3_rope(hf, lambda h: _rope(h, family))
    else:
        theta, rope_scaling = _rope(hf, family)
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim")
    bias = bool(hf.get("attention_bias", family == "gpt_oss"))
    kw: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size") or 0),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim or hidden // heads),
        layer_types=layer_types,
        sliding_window=window,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        attention_bias=bias and family != "mistral",
        o_proj_bias=bias and family in ("llama", "qwen3", "gpt_oss", "qwen3_5", "bamba"),
        mlp_bias=bool(hf.get("mlp_bias", False)) and family == "llama",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings"),
        dtype=resolve_dtype(dtype, hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_eos(hf, generation_config),
        hidden_act=act,
    )
    if family == "qwen3":
        kw["qk_norm"] = True
    elif family == "qwen3_5":
        kw.update(qwen3_5_kwargs(hf))
    elif family == "bamba":
        kw.update(bamba_kwargs(hf))
    elif family == "lfm2":
        kw.update(
            qk_norm=True,
            intermediate_size=_lfm2_ffn_width(hf),
            conv_L_cache=int(hf.get("conv_L_cache", 3)),
            conv_bias=bool(hf.get("conv_bias", False)),
            rms_norm_eps=float(hf.get("norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_embedding", hf.get("tie_word_embeddings", True))),
        )
    elif family in ("gemma2", "gemma3"):
        from tokenspeed_jax.hf.gemma import gemma_kwargs

        kw.update(gemma_kwargs(hf, family))
        if family == "gemma3":
            kw.update(rope_local_theta=local_rope[0], rope_local_scaling=local_rope[1])
    elif family == "gpt_oss":
        kw.update(
            attention_sinks=True,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            num_local_experts=int(hf.get("num_local_experts") or hf.get("num_experts") or 128),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 4)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        )
    return ModelConfig(**kw)
