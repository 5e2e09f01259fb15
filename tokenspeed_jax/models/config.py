"""`ModelConfig`: one frozen config for the generic decoder (Llama, Qwen3, Mistral, LFM2, GPT-OSS,
Gemma 2, Gemma 3).

Field names follow Hugging Face `config.json` where one exists, so a loader can build a
`ModelConfig` mostly by copying keys (`tokenspeed_jax.hf.config` does, per architecture).
RoPE variants are in models/rope.py, mixture-of-experts in models/moe.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention", "conv", "linear_attention", "mamba")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only model.

    layer_types[i] is "full_attention", "sliding_attention" (window `sliding_window` tokens:
    a query at position n reads [n - W + 1, n]) or "conv" (LFM2 short causal depthwise conv of
    kernel `conv_L_cache`) or "linear_attention" (Gated DeltaNet, models/gated_delta.py) or
    "mamba" (Mamba2, models/mamba2.py); the last two keep a recurrent state per request in the
    state cache group.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    conv_L_cache: int = 3  # LFM2 name for the conv kernel size K
    conv_bias: bool = False  # bias of in_proj / conv / out_proj in conv blocks (LFM2)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Any = dataclasses.field(default=None, compare=False, hash=False)
    qk_norm: bool = False  # Qwen3 / LFM2: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False  # bias on q/k/v projections (GPT-OSS, Qwen2)
    o_proj_bias: bool = False  # bias on o_proj (GPT-OSS)
    attention_sinks: bool = False  # GPT-OSS: learned per-head logit in the softmax denominator
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    sm_scale: float | None = None  # None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    final_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(logits / cap)
    hidden_act: str = "silu"  # gated MLP activation: "silu" (SwiGLU) | "gelu_pytorch_tanh" (GeGLU)
    norm_weight_offset: float = 0.0  # RMSNorm scale = offset + weight (Gemma: 1.0, weights init 0)
    sandwich_norms: bool = False  # Gemma 2/3: norm the mixer / MLP outputs too (4 norms per layer)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of sliding layers (None = rope_theta)
    rope_local_scaling: Any = dataclasses.field(default=None, compare=False, hash=False)
    mlp_bias: bool = False
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * f dims only (Qwen3.5: 0.25)
    attn_output_gate: bool = False  # Qwen3.5: q_proj also gives a per-head gate, o *= sigmoid(gate)
    # Gated DeltaNet ("linear_attention" layers, HF Qwen3.5 names)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Mamba2 ("mamba" layers, HF Bamba / GraniteMoeHybrid names): H heads of head dim P, state N
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_n_groups: int = 1  # B and C are shared by H / G consecutive heads
    mamba_d_state: int = 0
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False  # in_proj / out_proj bias
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))  # clamp of the softplus'ed time step
    num_local_experts: int = 0  # MoE (GPT-OSS, models/moe.py); 0 = dense SwiGLU MLP
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702  # MoE experts: gate * sigmoid(alpha * gate)
    swiglu_limit: float | None = None  # MoE experts: clamp of gate (above) and up (both sides)
    max_position_embeddings: int | None = None  # context the checkpoint was trained for (HF)
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # activations and parameters
    init_scale: float = 1.0  # weight init std multiplier (random models only)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            raise ValueError("layer_types is empty")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ValueError(f"layer {i}: unknown layer type {t!r} (known: {LAYER_TYPES})")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if "conv" in self.layer_types and self.conv_L_cache < 1:
            raise ValueError(f"conv_L_cache must be >= 1, got {self.conv_L_cache}")
        if "linear_attention" in self.layer_types:
            dims = dict(
                linear_num_key_heads=self.linear_num_key_heads,
                linear_num_value_heads=self.linear_num_value_heads,
                linear_key_head_dim=self.linear_key_head_dim,
                linear_value_head_dim=self.linear_value_head_dim,
                linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            )
            bad = {k: v for k, v in dims.items() if not v > 0}
            if bad:
                raise ValueError(f"linear_attention layers need positive {bad}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                    f"linear_num_key_heads {self.linear_num_key_heads}"
                )
        if "mamba" in self.layer_types:
            dims = dict(
                mamba_n_heads=self.mamba_n_heads,
                mamba_d_head=self.mamba_d_head,
                mamba_n_groups=self.mamba_n_groups,
                mamba_d_state=self.mamba_d_state,
                mamba_d_conv=self.mamba_d_conv,
            )
            bad = {k: v for k, v in dims.items() if not v > 0}
            if bad:
                raise ValueError(f"mamba layers need positive {bad}")
            if self.mamba_n_heads % self.mamba_n_groups:
                raise ValueError(
                    f"mamba_n_heads {self.mamba_n_heads} is not a multiple of "
                    f"mamba_n_groups {self.mamba_n_groups}"
                )
        if not 0.0 < self.partial_rotary_factor <= 1.0 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and give an "
                f"even number of rotary dims of head_dim {self.head_dim}"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (supported: {HIDDEN_ACTS})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def scale(self) -> float:
        return self.sm_scale if self.sm_scale is not None else self.head_dim**-0.5

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's short conv: q, k (key heads) and v (value heads)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of a Mamba2 layer's short conv: x (H * P) then B and C (G * N each)."""
        return self.mamba_n_heads * self.mamba_d_head + 2 * self.mamba_n_groups * self.mamba_d_state

    def rope_of(self, layer: int) -> tuple[float, Any]:
        """(theta, scaling) of layer `layer`'s RoPE: sliding layers use the local base if set."""
        if self.rope_local_theta is not None and self.layer_types[layer] == "sliding_attention":
            return self.rope_local_theta, self.rope_local_scaling
        return self.rope_theta, self.rope_scaling

    def window_of(self, layer: int) -> int | None:
        """Attention window of layer `layer` (None = full history); conv layers: None."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
