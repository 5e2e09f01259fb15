"""Gemma 2 / Gemma 3 (text) `config.json` -> `ModelConfig` switches.

Both families (transformers' `Gemma2ForCausalLM`, `Gemma3ForCausalLM`):
* RMSNorm scale `1 + weight` (weights stored zero-centred) -> `norm_weight_offset=1`;
* four norms per layer (input, post-attention, pre/post feed-forward) -> `sandwich_norms`;
* embeddings times sqrt(hidden_size) (rounded to the model dtype) -> `embed_scale`;
* softmax scale `query_pre_attn_scalar ** -0.5` -> `sm_scale`;
* GeGLU MLP (`hidden_activation` = gelu_pytorch_tanh); tied embeddings by default.
Gemma 2: attention logit soft-cap (`attn_logit_softcapping`, default 50) and final logit soft-cap
(`final_logit_softcapping`, default 30); layers alternate sliding / full, starting with sliding.
Gemma 3: q/k RMSNorm over head_dim (also `1 + w`), no soft-caps (transformers' Gemma 3 attention
never applies `attn_logit_softcapping`, so neither do we), 5 sliding : 1 full
(`sliding_window_pattern`, default 6), and sliding layers use their own RoPE base
(`rope_parameters["sliding_attention"]`, or legacy `rope_local_base_freq`, default 10000) while
full layers use `rope_parameters["full_attention"]` (legacy `rope_theta` + `rope_scaling`, default 1e6).
Defaults are transformers' class defaults, since a saved config.json may omit default values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        hidden_activation="gelu_pytorch_tanh", head_dim=256, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        tie_word_embeddings=True, max_position_embeddings=8192,
    ),
    "gemma3": dict(
        hidden_activation="gelu_pytorch_tanh", head_dim=256, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        sliding_window=4096, final_logit_softcapping=None, tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
}  # fmt: skip


def gemma_defaults(family: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' defaults for keys a Gemma config.json may leave out."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention=True is not supported (causal only)")
    return dict(_DEFAULTS[family])


def gemma_layer_types(hf: Mapping[str, Any], family: str, n: int) -> list[str]:
    """Layer types when config.json has no `layer_types` (older Gemma configs)."""
    period = 2 if family == "gemma2" else int(hf.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]


def gemma3_rope(hf: Mapping[str, Any], rope: Callable[[Mapping[str, Any]], tuple[float, Any]]):
    """((theta, scaling) of full layers, (theta, scaling) of sliding layers) of a Gemma 3 config.

    `rope` parses one flat config (rope_parameters / rope_theta / rope_scaling), as `config._rope`.
    """
    params = hf.get("rope_parameters") or {}
    flat = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    if params and all(isinstance(v, Mapping) for v in params.values()):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # legacy: rope_theta (+ rope_scaling) for full layers, rope_local_base_freq for sliding
        full = {**(hf.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", hf.get("rope_theta", 1e6))
        local = {"rope_type": "default"}
    full.setdefault("rope_theta", 1e6)
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    return rope({**flat, "rope_parameters": full}), rope({**flat, "rope_parameters": local})


def gemma_kwargs(hf: Mapping[str, Any], family: str) -> dict[str, Any]:
    """`ModelConfig` keyword arguments specific to Gemma 2 / 3."""
    hidden = int(hf["hidden_size"])
    attn_cap = hf.get("attn_logit_softcapping") if family == "gemma2" else None
    final_cap = hf.get("final_logit_softcapping")
    return dict(
        norm_weight_offset=1.0,
        sandwich_norms=True,
        embed_scale=hidden**0.5,
        sm_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
        attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
        final_logit_softcapping=None if final_cap is None else float(final_cap),
        qk_norm=family == "gemma3",
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(hf.get("attention_bias", False)),
        o_proj_bias=bool(hf.get("attention_bias", False)),
    )
