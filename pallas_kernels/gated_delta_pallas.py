"""One chunk of the gated delta rule (Gated DeltaNet) as a Pallas GPU (Triton) kernel.

Same contract as the jnp `gated_delta_chunk.chunk_jnp` (its reference, exported here as
`gated_delta_chunk_reference`): from state f32[H, Dk, Dv], a chunk of C tokens q k f[C, H, Dk],
v f[C, H, Dv], g beta f[C, H] -> (o f32[C, H, Dv], state after the chunk f32[H, Dk, Dv]), the WY /
UT-transform form with float32 accumulation. `gated_delta._chunk_fn` runs it inside the chunked
and packed drivers when `GatedDeltaConfig.chunk_impl` picks it (by default on a GPU).

Kernel design (Triton lowering, see `backend.py`):
- The grid is `(H, Dv / block_v)`: one program owns one head's [Dk, block_v] slice of the state
  (Dv is independent across columns of the state: every column follows the same recurrence with
  the same keys and decays). Many programs per head keep the SMs busy at H = 16..32 heads; the
  price is that each one recomputes its head's [C, C] work (decays, k k^T, the inverse, q k^T).
- Per program, in registers (Triton's dot operands pass through shared memory): the head's
  decays (`gated_delta_chunk.segment_decays`: the segment sums are summed directly, never as
  cum_i - cum_j), the UT system N = beta_i k_i.k_j decay_ij (strictly lower), (I + N)^-1 by the
  matmul-only series (`gated_delta_chunk.unit_lower_inverse`, no triangular solve), the state slice
  and the [C, block_v] corrected values; the [C, Dk] key / query tiles are loaded once each.
- float32 dots ask for IEEE precision (never TF32: the inverse's series and strong decays need
  the full mantissa); bf16 q / k go to the tensor cores as they are (bf16 x bf16 products are
  exact in float32), everything else is float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend
from pallas_kernels.backend import Ref
from pallas_kernels.gated_delta_chunk import chunk_jnp as gated_delta_chunk_reference
from pallas_kernels.gated_delta_chunk import segment_decays, unit_lower_inverse

__all__ = [
    "GatedDeltaPallasConfig",
    "gated_delta_chunk",
    "gated_delta_chunk_reference",
    "supported",
]


@dataclasses.dataclass(frozen=True)
class GatedDeltaPallasConfig:
    """Tuning: `block_v` value columns of the state per program (capped at Dv; power of two).
    Defaults from `ptxas -v` at C = 64, H = 32, Dk = Dv = 128, bf16 (sm_90a, no GPU run yet):
    8 warps x 32 columns spill 12.7 KB per thread block, 4 x 32 spill 47 KB, 8 x 64 26 KB."""

    block_v: int = 32
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self) -> None:
        backend.check_config(self, powers_of_2=("block_v", "num_warps"))


def supported(chunk: int, dk: int, dv: int) -> bool:
    """Whether the kernel takes chunks of `chunk` tokens with key / value widths dk / dv: Triton
    tiles are powers of two and its dots want every dimension >= 16."""
    return backend.triton_dims_ok(chunk, dk, dv)


def _check_inputs(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> None:
    if q.ndim != 3 or q.shape != k.shape or q.dtype != k.dtype:
        raise ValueError(f"{q.shape=} {k.shape=} ({q.dtype}, {k.dtype}): q and k must both be [C, H, Dk]")
    c, h, dk = q.shape
    if v.ndim != 3 or v.shape[:2] != (c, h):
        raise ValueError(f"{v.shape=} must be [{c}, {h}, Dv] ({q.shape=})")
    dv = v.shape[2]
    if g.shape != (c, h) or beta.shape != (c, h):
        raise ValueError(f"{g.shape=} {beta.shape=} must both be ({c}, {h})")
    if state.shape != (h, dk, dv) or state.dtype != jnp.float32:
        raise ValueError(f"{state.shape=} ({state.dtype}) must be float32 [{h}, {dk}, {dv}]")
    for x in (q, v, g, beta):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{x.shape=} ({x.dtype}) must be floating")
    if not supported(c, dk, dv):
        raise ValueError(f"{q.shape=} {v.shape=}: C, Dk and Dv must be powers of two >= 16 for the kernel")


def _kernel(
    state_ref: Ref,
    q_ref: Ref,
    k_ref: Ref,
    v_ref: Ref,
    g_ref: Ref,
    beta_ref: Ref,
    o_ref: Ref,
    new_state_ref: Ref,
    *,
    chunk: int,
    dk: int,
    block_v: int,
) -> None:
    h, col0 = pl.program_id(0), pl.program_id(1) * block_v
    t = lax.iota(jnp.int32, chunk)
    kd = lax.iota(jnp.int32, dk)
    vd = col0 + lax.iota(jnp.int32, block_v)
    f32 = functools.partial(lax.convert_element_type, new_dtype=jnp.float32)
    # The head's decays: every later product is masked to the lower triangle through `decay`
    # (0 above the diagonal), so no separate masks for the intra-chunk matrices are needed.
    g = f32(backend.load(g_ref, (t, h)))
    beta = f32(backend.load(beta_ref, (t, h)))
    cum, seg, decay = segment_decays(g)  # [C], [C, C], [C, C]
    strict = t[:, None] > t[None, :]
    # seg's last row (decay from token j to the chunk end), as a masked column sum: Triton has no
    # static slice of a register tile.
    tail = jnp.sum(jnp.where(t[:, None] == chunk - 1, seg, 0.0), axis=0)

    k = backend.load(k_ref, (t[:, None], h, kd[None, :]))  # [C, Dk], input dtype
    # N_ij = beta_i k_i.k_j decay_ij for j < i: the UT transform's strictly lower system.
    system = jnp.where(strict, backend.dot(k, k, trans_b=True) * beta[:, None] * decay, 0.0)
    inv = unit_lower_inverse(system, backend.dot)  # (I + N)^-1, [C, C]
    kf = f32(k)
    w = backend.dot(inv, kf * (beta * jnp.exp(cum))[:, None])  # [C, Dk]
    state = backend.load(state_ref, (h, kd[:, None], vd[None, :]))  # [Dk, BV] f32
    v = f32(backend.load(v_ref, (t[:, None], h, vd[None, :])))  # [C, BV]
    # The part of each write that the carried state does not already predict.
    v_new = backend.dot(inv, v * beta[:, None]) - backend.dot(w, state)  # [C, BV]

    # Loaded late so the query tile is not live across the inverse (register pressure).
    q = backend.load(q_ref, (t[:, None], h, kd[None, :]))  # [C, Dk]
    intra = backend.dot(q, k, trans_b=True) * decay  # causal: decay is 0 above the diagonal
    out = backend.dot(f32(q) * jnp.exp(cum)[:, None], state) + backend.dot(intra, v_new)
    backend.store(o_ref, (t[:, None], h, vd[None, :]), out)

    k_tail = kf * jnp.exp(tail)[:, None]  # each key decayed to the chunk end
    last = jnp.sum(jnp.where(t == chunk - 1, cum, 0.0))  # the whole chunk's log-decay
    new_state = state * jnp.exp(last) + backend.dot(k_tail.T, v_new)
    backend.store(new_state_ref, (h, kd[:, None], vd[None, :]), new_state)


def gated_delta_chunk(
    state: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    interpret: bool = False,
    config: GatedDeltaPallasConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One chunk of C tokens (Pallas GPU kernel; `interpret=True` runs it on CPU).

    Args:
      state: f32[H, Dk, Dv], the state before the chunk.
      q, k: f[C, H, Dk] (same dtype; float32 or bfloat16), q already scaled by Dk ** -0.5.
      v: f[C, H, Dv].
      g, beta: f[C, H] log-decays (<= 0) and write strengths. Tokens with k = v = 0, g = beta = 0
        (padding) change nothing.
      interpret: run the kernel with the Pallas interpreter (CPU tests).
      config: tuning; None = `GatedDeltaPallasConfig()`.
    C, Dk and Dv must be powers of two >= 16 (`supported`).

    Returns:
      (o f32[C, H, Dv], state after the chunk f32[H, Dk, Dv]), as `gated_delta_chunk_reference`.
    """
    _check_inputs(state, q, k, v, g, beta)
    cfg = config or GatedDeltaPallasConfig()
    c, h, dk = q.shape
    dv = v.shape[2]
    block_v = min(cfg.block_v, dv)
    kernel = functools.partial(_kernel, chunk=c, dk=dk, block_v=block_v)
    call = backend.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((c, h, dv), jnp.float32),
            jax.ShapeDtypeStruct((h, dk, dv), jnp.float32),
        ],
        grid=(h, dv // block_v),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
        name=f"gated_delta_chunk_c{c}_bv{block_v}",
    )
    o, new_state = call(state, q, k, v, g, beta)
    return o, new_state
