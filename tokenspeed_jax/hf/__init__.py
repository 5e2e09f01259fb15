"""Hugging Face checkpoints: config.json + safetensors + tokenizer.json -> our model.

`load_checkpoint(path, dtype=...) -> (ModelConfig, CausalLM, tokenizer)` is what `LLM(model=DIR)`
calls. Supported architectures: see `SUPPORTED_ARCHITECTURES`; anything else (or a missing file)
is a ValueError that says what is supported / what is missing.
"""

from __future__ import annotations

import json
import os

from tokenspeed_jax.hf.config import SUPPORTED_ARCHITECTURES, family_of, model_config_from_hf
from tokenspeed_jax.hf.tokenizer import HFTokenizer
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.decoder import CausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "HFTokenizer", "load_checkpoint", "load_config", "model_config_from_hf"]


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_config(path: str, *, dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` of checkpoint directory `path` (config.json + generation_config.json)."""
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a checkpoint directory")
    hf = _read_json(os.path.join(path, "config.json"))
    if hf is None:
        raise ValueError(f"{path}: no config.json (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    generation = _read_json(os.path.join(path, "generation_config.json"))
    return model_config_from_hf(hf, dtype=dtype, generation_config=generation)


def load_checkpoint(
    path: str, *, dtype: str = "float32", lazy: bool = False
) -> tuple[ModelConfig, CausalLM, HFTokenizer | None]:
    """Loads config, weights (cast to `dtype`: float32 | bfloat16 | float16 | auto) and tokenizer.

    lazy=True leaves the weights unread (`param_sources.CheckpointSource`s): `sharding.place`
    reads each process's shards only (multi-process runs).

    The tokenizer is None when the directory has no tokenizer.json (token-id prompts still work).
    """
    from tokenspeed_jax.hf.weights import checkpoint_files, load_model

    cfg = load_config(path, dtype=dtype)
    family = family_of(_read_json(os.path.join(path, "config.json")) or {})
    model = load_model(cfg, family, checkpoint_files(path), lazy=lazy)
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, tuple) else (() if eos is None else (eos,))
    tokenizer = None
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        tokenizer = HFTokenizer.from_dir(path, model_eos=eos_ids)
    return cfg, model, tokenizer
