"""Model zoo: one generic decoder (`CausalLM`) configured by a frozen `ModelConfig`."""

from __future__ import annotations

from tokenspeed_jax.models.batch import PagedBatch
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.decoder import CausalLM
from tokenspeed_jax.models.registry import (
    BUILTIN_MODELS,
    build_model,
    cache_group_specs,
    layer_groups,
    load_builtin,
    tiny_random_config,
)

__all__ = [
    "BUILTIN_MODELS",
    "CausalLM",
    "ModelConfig",
    "PagedBatch",
    "build_model",
    "cache_group_specs",
    "layer_groups",
    "load_builtin",
    "tiny_random_config",
]
