"""Model zoo: one generic decoder (`CausalLM`) configured by a frozen `ModelConfig`."""

from __future__ import annotations

from tokenspeed_jax.models.batch import PagedBatch
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.decoder import CausalLM
from tokenspeed_jax.models.registry import (
    BUILTIN_MODELS,
    MODEL_ALIASES,
    build_model,
    load_builtin,
    resolve_alias,
    tiny_random_config,
)

__all__ = [
    "BUILTIN_MODELS",
    "MODEL_ALIASES",
    "CausalLM",
    "ModelConfig",
    "PagedBatch",
    "build_model",
    "load_builtin",
    "resolve_alias",
    "tiny_random_config",
]
