"""Short causal depthwise convolution (LFM2-style conv layers) over a paged conv-input pool.

The cache holds each past token's conv INPUT, position-addressed: position p of request s lives in
page `page_table[s, p // page_size]` at offset `p % page_size` of `conv_pages f[P, page_size, C]`.
For this step's token at absolute position `pos`, tap j (0 <= j < K) multiplies the input at
`p = pos - (K-1) + j`, taken from
- the packed activations `x` when p is inside this step's chunk of that request,
- the pool when `0 <= p <` chunk start (only the K-1 positions just before the chunk are read),
- zero when p < 0.
A decode step (one query token) therefore reads its K-1 previous inputs from the pool.

Persistence contract (runtime side: `write_idx` of `tokenspeed_jax.models.batch.make_paged_batch`):
conv groups are sliding groups with W = K and live-tail allocation, so the runtime stores a token's
conv input only where the page table holds a real page; a hole (page 0) means live-tail decided no
future step reads it. Older slots may be holes full of garbage; this kernel never touches them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend, pool_bits
from pallas_kernels.backend import Ref
from pallas_kernels.ragged import check_ragged_metadata, token_layout

__all__ = ["ShortConvConfig", "short_conv", "short_conv_reference"]


@dataclasses.dataclass(frozen=True)
class ShortConvConfig:
    """Tuning: `block_t` tokens x `block_c` channels per program (powers of two)."""

    block_t: int = 16
    block_c: int = 128
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        backend.check_config(self, powers_of_2=("block_t", "block_c", "num_warps"))


def _check_inputs(
    x: jax.Array,
    conv_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    bits_pools: bool = False,
) -> None:
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{x.shape=} ({x.dtype}) must be float [T, C]")
    t, c = x.shape
    if conv_pages.ndim != 3 or conv_pages.shape[2] != c:
        raise ValueError(f"{conv_pages.shape=} must be [P, page_size, C] with C={c} ({x.shape=})")
    # the reference also takes a bf16 / f16 pool as its uint16 bits (pool_bits)
    bits = bits_pools and pool_bits.holds(conv_pages.dtype, x.dtype)
    if not (jnp.issubdtype(conv_pages.dtype, jnp.floating) or bits):
        raise ValueError(
            f"{conv_pages.dtype=} must be floating"
            + (f" (or uint16 bits of {x.dtype=})" if bits_pools else "")
        )
    if weight.ndim != 2 or weight.shape[1] != c or weight.shape[0] < 1:
        raise ValueError(f"{weight.shape=} must be [K >= 1, C] with C={c}")
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"{bias.shape=} must be ({c},)")
    check_ragged_metadata(page_table, kv_lens, cu_q_lens, num_seqs)


def _kernel(
    meta_ref: Ref,
    pt_ref: Ref,
    x_ref: Ref,
    pool_ref: Ref,
    w_ref: Ref,
    b_ref: Ref,
    y_ref: Ref,
    *,
    taps: int,
    block_t: int,
    block_c: int,
    num_tokens: int,
    channels: int,
    page_size: int,
    pool_tokens: int,
) -> None:
    t = pl.program_id(0) * block_t + lax.iota(jnp.int32, block_t)
    c = pl.program_id(1) * block_c + lax.iota(jnp.int32, block_c)
    t_ok, c_ok = t < num_tokens, c < channels
    t_idx = jnp.where(t_ok, t, num_tokens)  # out-of-range sentinel for masked lanes
    seq, pos, valid, start = (backend.load(meta_ref, (i, t_idx), mask=t_ok, other=0) for i in range(4))
    valid = t_ok & (valid != 0)
    acc = jnp.zeros((block_t, block_c), jnp.float32)
    for j in range(taps):  # K is small (2-4 in LFM2): unrolled
        p = pos - (taps - 1) + j
        from_x = valid & (p >= start)
        from_pool = valid & (p < start) & (p >= 0)
        xv = backend.load(
            x_ref,
            (jnp.where(from_x, t - (taps - 1) + j, num_tokens)[:, None], c[None, :]),
            mask=from_x[:, None] & c_ok[None, :],
            other=0.0,
        )
        slot = jnp.where(from_pool, p // page_size, 0)
        page = backend.load(pt_ref, (seq, slot), mask=from_pool, other=0)
        flat = jnp.where(from_pool, page * page_size + p % page_size, pool_tokens)
        pv = backend.load(
            pool_ref, (flat[:, None], c[None, :]), mask=from_pool[:, None] & c_ok[None, :], other=0.0
        )
        tap = jnp.where(from_x[:, None], xv.astype(jnp.float32), pv.astype(jnp.float32))
        w = backend.load(w_ref, (j, c), mask=c_ok, other=0.0).astype(jnp.float32)
        acc = acc + tap * w[None, :]
    acc = acc + backend.load(b_ref, (c,), mask=c_ok, other=0.0).astype(jnp.float32)[None, :]
    y = jnp.where(valid[:, None], acc, 0.0)
    backend.store(
        y_ref, (t_idx[:, None], c[None, :]), y.astype(y_ref.dtype), mask=t_ok[:, None] & c_ok[None, :]
    )


def short_conv(
    x: jax.Array,
    conv_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    interpret: bool = False,
    config: ShortConvConfig | None = None,
) -> jax.Array:
    """Causal depthwise conv of this step's tokens, earlier taps read through the page table.

    Args:
      x: f[T, C] packed conv inputs of this step's tokens (same packing as paged_attention).
      conv_pages: f[P, page_size, C] pool of past conv inputs, position-addressed.
      page_table: i32[S, max_pages] (0 = hole); kv_lens i32[S] incl. this step's tokens;
      cu_q_lens: i32[S+1]; num_seqs: i32[1].
      weight: f[K, C]; tap j multiplies the input at position pos - (K-1) + j.
      bias: f[C] or None.
    Returns:
      y f[T, C] in x's dtype (float32 accumulation); padding tokens are zeros.
    """
    _check_inputs(x, conv_pages, page_table, kv_lens, cu_q_lens, num_seqs, weight, bias)
    cfg = config or ShortConvConfig()
    t, c = x.shape
    num_pages, page_size, _ = conv_pages.shape
    if t == 0:
        return jnp.zeros_like(x)
    lay = token_layout(cu_q_lens, kv_lens, num_seqs, t, page_table.shape[1] * page_size)
    meta = jnp.stack([lay.seq, lay.pos, lay.valid.astype(jnp.int32), lay.chunk_start])
    kernel = functools.partial(
        _kernel,
        taps=weight.shape[0],
        block_t=cfg.block_t,
        block_c=cfg.block_c,
        num_tokens=t,
        channels=c,
        page_size=page_size,
        pool_tokens=num_pages * page_size,
    )
    call = backend.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(t, cfg.block_t), pl.cdiv(c, cfg.block_c)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
        name=f"short_conv_k{weight.shape[0]}",
    )
    b = bias if bias is not None else jnp.zeros((c,), weight.dtype)
    y: jax.Array = call(
        meta.astype(jnp.int32),
        page_table.astype(jnp.int32),
        x,
        conv_pages.reshape(num_pages * page_size, c),
        weight,
        b,
    )
    return y


def short_conv_reference(
    x: jax.Array,
    conv_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Pure-jnp twin of `short_conv` (same arguments and result; `interpret` is ignored)."""
    del interpret
    _check_inputs(x, conv_pages, page_table, kv_lens, cu_q_lens, num_seqs, weight, bias, bits_pools=True)
    t, c = x.shape
    _, page_size, _ = conv_pages.shape
    max_pages = page_table.shape[1]
    lay = token_layout(cu_q_lens, kv_lens, num_seqs, t, max_pages * page_size)
    taps = weight.shape[0]
    tok = jnp.arange(t)
    acc = jnp.zeros((t, c), jnp.float32)
    for j in range(taps):
        p = lay.pos - (taps - 1) + j
        from_x = lay.valid & (p >= lay.chunk_start)
        from_pool = lay.valid & (p < lay.chunk_start) & (p >= 0)
        xv = x[jnp.clip(tok - (taps - 1) + j, 0, t - 1)].astype(jnp.float32)
        page = page_table[lay.seq, jnp.clip(p // page_size, 0, max_pages - 1)]
        pv = pool_bits.take(conv_pages, (page, p % page_size), x.dtype).astype(jnp.float32)
        tap = jnp.where(from_x[:, None], xv, jnp.where(from_pool[:, None], pv, 0.0))
        acc = acc + tap * weight[j].astype(jnp.float32)
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return jnp.where(lay.valid[:, None], acc, 0.0).astype(x.dtype)
