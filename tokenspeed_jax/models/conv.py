"""LFM2-style short causal depthwise conv block, dense and paged.

in_proj -> (B, C, x); u = B * x is the conv input; y = C * conv_K(u); out_proj(y).
The paged form persists each token's u position-addressed in the conv group's pool
(`conv_pages f[num_pages, B_g, C]`, live-tail sliding group with W = K); the taps themselves are
`pallas_kernels.short_conv` / `short_conv_reference` (K-1 previous inputs from the packed
activations when they are in this step's chunk, else from the pool through the page table,
DESIGN.md §7; negative positions read zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import pool_bits, short_conv_reference
from tokenspeed_jax.models.batch import PagedBatch
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.layers import Linear


class ShortConv(nnx.Module):
    """Params: in_proj [H, 3H], conv_weight [K, H] (HF `conv.weight` [H, 1, K] transposed),
    conv_bias [H] (if cfg.conv_bias), out_proj [H, H]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, k = cfg.hidden_size, cfg.conv_L_cache
        self.in_proj = Linear(h, 3 * h, bias=cfg.conv_bias, cfg=cfg, rngs=rngs)
        w = jax.random.normal(rngs.params(), (k, h), jnp.float32) * cfg.init_scale / k**0.5
        self.conv_weight = nnx.Param(w.astype(cfg.dtype))
        self.conv_bias = nnx.Param(jnp.zeros((h,), cfg.dtype)) if cfg.conv_bias else None
        self.out_proj = Linear(h, h, bias=cfg.conv_bias, cfg=cfg, rngs=rngs)
        self.kernel_size = k
        # Column layout of in_proj: 1 = [B | C | x]; n = tensor-parallel re-layout by
        # `tokenspeed_jax.runtime.sharding.relayout_conv`, [B_0 C_0 x_0 | ... | B_n-1 C_n-1 x_n-1] with
        # shard s's channels side by side, so each shard's gates are local (no resharding).
        self.gate_shards = 1

    def _gates(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = self.in_proj(x)
        lead, n = y.shape[:-1], self.gate_shards
        y = y.reshape(*lead, n, 3, y.shape[-1] // (3 * n))
        b, c, xx = (y[..., j, :].reshape(*lead, -1) for j in range(3))
        return b * xx, c

    def _finish(self, taps: list[jax.Array], c: jax.Array) -> jax.Array:
        """taps[j] f[T, H] = conv input j tokens back (j = 0 is the token itself)."""
        w = self.conv_weight[...]
        k = self.kernel_size
        acc = sum(taps[j] * w[k - 1 - j] for j in range(k))  # torch conv1d is cross-correlation
        if self.conv_bias is not None:
            acc = acc + self.conv_bias[...]
        return self.out_proj(c * acc)

    def dense(self, x: jax.Array) -> jax.Array:
        """Whole sequence x f[S, H] -> f[S, H] with a plain causal conv (test oracle)."""
        u, c = self._gates(x)
        s = u.shape[0]
        padded = jnp.pad(u, ((self.kernel_size - 1, 0), (0, 0)))
        taps = [
            padded[self.kernel_size - 1 - j : self.kernel_size - 1 - j + s] for j in range(self.kernel_size)
        ]
        return self._finish(taps, c)

    def paged(
        self, x: jax.Array, cache: dict, batch: PagedBatch, group: int, conv_fn=None
    ) -> tuple[jax.Array, dict]:
        """Packed tokens x f[T, H]; cache {"conv": f[P, B_g, H]} -> (f[T, H], new cache).

        conv_fn: `pallas_kernels.short_conv` or `short_conv_reference` (signature
        `(x, conv_pages, page_table, kv_lens, cu_q_lens, num_seqs, weight, bias)`, weight f[K, C],
        tap j at position pos - (K-1) + j; None = the reference): this step's inputs are written
        first, then it reads in-chunk taps from x and earlier ones from the pool.
        """
        if conv_fn is None:
            conv_fn = short_conv_reference
        u, c = self._gates(x)
        pool = cache["conv"]
        num_pages, bs, h = pool.shape
        flat = pool.reshape(num_pages * bs, h)
        flat = pool_bits.scatter_set(flat, batch.write_idx[group], u)  # uint16 pool: as bits
        new_cache = {"conv": flat.reshape(num_pages, bs, h)}
        bias = None if self.conv_bias is None else self.conv_bias[...]
        y = conv_fn(
            u, new_cache["conv"], batch.page_tables[group], batch.kv_lens, batch.cu_q_lens,
            batch.num_seqs, self.conv_weight[...], bias,
        )  # fmt: skip
        return self.out_proj(c * y), new_cache
