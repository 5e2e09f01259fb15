"""Bamba (`BambaForCausalLM`, Mamba2 + attention hybrid) `config.json` -> `ModelConfig` switches.

* layers: attention at `attn_layer_indices`, Mamba2 ("mamba", models/mamba2.py) everywhere else;
* Mamba2 sizes: `mamba_n_heads` heads of `mamba_d_head` (or "auto" = expand * hidden / heads),
  `mamba_n_groups` B/C groups, state `mamba_d_state`, conv `mamba_d_conv` (+ bias), the time step
  clamp `time_step_limit`;
* partial RoPE on half of head_dim (transformers hard-codes `partial_rotary_factor` = 0.5);
* Llama-style attention and SwiGLU MLP (`feed_forward`, `pre_ff_layernorm` and `final_layernorm`
  in the checkpoint: hf/weights.py renames them).
Defaults are transformers' `BambaConfig` defaults, since a saved config.json may omit them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _number(value: Any) -> float:
    """A float of config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, Mapping) else value)


def bamba_layer_types(hf: Mapping[str, Any], n: int) -> list[str]:
    attn = set(hf.get("attn_layer_indices") or [])
    return ["full_attention" if i in attn else "mamba" for i in range(n)]


def bamba_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig fields particular to Bamba."""
    hidden = int(hf["hidden_size"])
    heads = int(hf.get("mamba_n_heads") or 128)
    d_head = hf.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        d_head = int(hf.get("mamba_expand", 2)) * hidden // heads
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
    return dict(
        partial_rotary_factor=0.5,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        mamba_n_heads=heads,
        mamba_d_head=int(d_head),
        mamba_n_groups=int(hf.get("mamba_n_groups") or 1),
        mamba_d_state=int(hf.get("mamba_d_state") or 256),
        mamba_d_conv=int(hf.get("mamba_d_conv") or 4),
        mamba_conv_bias=bool(hf.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(hf.get("mamba_proj_bias", False)),
        mamba_dt_limit=(_number(limit[0]), _number(limit[1])),
    )
