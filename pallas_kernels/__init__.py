"""Pallas GPU kernels, each beside its pure-jnp reference. Imports only jax (+numpy)."""

from pallas_kernels.paged_attention import (
    PagedAttentionConfig,
    default_config,
    paged_attention,
    paged_attention_reference,
)

__all__ = [
    "PagedAttentionConfig",
    "default_config",
    "paged_attention",
    "paged_attention_reference",
]
