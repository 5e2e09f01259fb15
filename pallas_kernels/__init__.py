"""Pallas GPU kernels, each beside its pure-jnp reference. Imports only jax (+numpy)."""

from pallas_kernels.paged_attention import (
    DECODE_TUNING_CANDIDATES,
    MixedConfig,
    PagedAttentionConfig,
    default_config,
    mixed_config,
    paged_attention,
    paged_attention_reference,
)
from pallas_kernels.short_conv import ShortConvConfig, short_conv, short_conv_reference

__all__ = [
    "DECODE_TUNING_CANDIDATES",
    "MixedConfig",
    "PagedAttentionConfig",
    "ShortConvConfig",
    "default_config",
    "mixed_config",
    "paged_attention",
    "paged_attention_reference",
    "short_conv",
    "short_conv_reference",
]
