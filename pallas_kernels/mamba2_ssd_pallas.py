"""One chunk of the Mamba2 SSD recurrence as a Pallas GPU (Triton) kernel.

Same contract as the jnp `mamba2_ssd_chunk.chunk_jnp` (its reference, exported here as
`ssd_chunk_reference`): from state f32[H, P, N], a chunk of C tokens x f[C, H, P], dt f[C, H],
A f[H], B C f[C, G, N] -> (y f32[C, H, P], state after the chunk f32[H, P, N]). `mamba2_ssd`'s
chunked and packed drivers run it when `Mamba2Config.chunk_impl` picks it.

Kernel design (Triton lowering, see `backend.py`):
- The grid is `(H, P / block_p)`: one program owns one head's [block_p, N] slice of the state
  (every head-dim row of the state follows the same recurrence with the same B, C and decays).
  Each program recomputes its head's [C, C] work (the decays and the C B^T scores), which is
  small beside the [C, C] x [C, block_p] products at Mamba2's P = 64, N = 128.
- Per program, in registers: the head's log-decays a = dt A, their segment sums
  (`gated_delta_chunk.segment_decays`, summed directly: dt A reaches -100 per token and
  cum_i - cum_j would cancel), the decayed scores C B^T, the state slice, x dt; the group's B / C
  tiles [C, N] are loaded once each. No inverse: SSD is the gated delta rule without the delta.
- float32 dots ask for IEEE precision (never TF32); bf16 B / C reach the tensor cores as they are
  for the scores, everything else is float32.
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
from pallas_kernels.gated_delta_chunk import segment_decays
from pallas_kernels.mamba2_ssd_chunk import chunk_jnp as ssd_chunk_reference

__all__ = ["SsdPallasConfig", "ssd_chunk", "ssd_chunk_reference", "supported"]


@dataclasses.dataclass(frozen=True)
class SsdPallasConfig:
    """Tuning: `block_p` head-dim rows of the state per program (capped at P; power of two).
    Defaults from `ptxas -v` at C = 64, H = 64 (Bamba-9B: P = 64, N = 128, 8 groups), bf16, sm_90a
    (`compile_check`; no GPU run yet): 255 registers everywhere; spills per thread block 1.3 KB
    at 16 rows x 8 warps (256 programs), 3.8 KB at 16 x 4, 3.6 KB at 32 x 8, 9.2 KB at 32 x 4,
    11.7 KB at 64 x 8, 24.7 KB at 64 x 4."""

    block_p: int = 16
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self) -> None:
        backend.check_config(self, powers_of_2=("block_p", "num_warps"))


def supported(chunk: int, p: int, n: int) -> bool:
    """Whether the kernel takes chunks of `chunk` tokens with head dim `p` and state size `n`:
    Triton tiles are powers of two and its dots want every dimension >= 16."""
    return backend.triton_dims_ok(chunk, p, n)


def _check_inputs(
    state: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array
) -> None:
    if x.ndim != 3:
        raise ValueError(f"{x.shape=} must be [C, H, P]")
    c, h, p = x.shape
    if dt.shape != (c, h) or A.shape != (h,):
        raise ValueError(f"{dt.shape=} {A.shape=} must be ({c}, {h}) and ({h},)")
    if B.ndim != 3 or B.shape != C.shape or B.shape[0] != c or B.dtype != C.dtype:
        raise ValueError(f"{B.shape=} {C.shape=} ({B.dtype}, {C.dtype}) must both be [{c}, G, N]")
    g, n = B.shape[1:]
    if g < 1 or h % g:
        raise ValueError(f"{B.shape=}: the group count must divide the {h} heads")
    if state.shape != (h, p, n) or state.dtype != jnp.float32:
        raise ValueError(f"{state.shape=} ({state.dtype}) must be float32 [{h}, {p}, {n}]")
    for v in (x, dt, A, B):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise ValueError(f"{v.shape=} ({v.dtype}) must be floating")
    if not supported(c, p, n):
        raise ValueError(f"{x.shape=} {B.shape=}: C, P and N must be powers of two >= 16 for the kernel")


def _kernel(
    state_ref: Ref,
    x_ref: Ref,
    dt_ref: Ref,
    a_ref: Ref,
    b_ref: Ref,
    c_ref: Ref,
    y_ref: Ref,
    new_state_ref: Ref,
    *,
    chunk: int,
    n: int,
    block_p: int,
    heads_per_group: int,
) -> None:
    h, row0 = pl.program_id(0), pl.program_id(1) * block_p
    grp = h // heads_per_group
    t = lax.iota(jnp.int32, chunk)
    nd = lax.iota(jnp.int32, n)
    pd = row0 + lax.iota(jnp.int32, block_p)
    f32 = functools.partial(lax.convert_element_type, new_dtype=jnp.float32)
    dt = f32(backend.load(dt_ref, (t, h)))  # [C]
    a = f32(backend.load(a_ref, (h + 0 * t,)))  # A[h] on every lane: a vector, not a scalar load
    cum, seg, decay = segment_decays(dt * a)  # [C], [C, C], [C, C]; decay is 0 above the diagonal
    # seg's last row (decay from token j to the chunk end), as a masked column sum: Triton has no
    # static slice of a register tile.
    tail = jnp.sum(jnp.where(t[:, None] == chunk - 1, seg, 0.0), axis=0)
    b = backend.load(b_ref, (t[:, None], grp, nd[None, :]))  # [C, N], input dtype
    c = backend.load(c_ref, (t[:, None], grp, nd[None, :]))
    scores = backend.dot(c, b, trans_b=True) * decay  # causal through decay
    xdt = f32(backend.load(x_ref, (t[:, None], h, pd[None, :]))) * dt[:, None]  # [C, BP]
    state = backend.load(state_ref, (h, pd[:, None], nd[None, :]))  # [BP, N] f32
    # the chunk's own tokens, plus the carried state read through C and decayed to each token
    y = backend.dot(scores, xdt) + backend.dot(f32(c) * jnp.exp(cum)[:, None], state, trans_b=True)
    backend.store(y_ref, (t[:, None], h, pd[None, :]), y)
    last = jnp.sum(jnp.where(t == chunk - 1, cum, 0.0))  # the whole chunk's log-decay
    new_state = state * jnp.exp(last) + backend.dot((xdt * jnp.exp(tail)[:, None]).T, f32(b))
    backend.store(new_state_ref, (h, pd[:, None], nd[None, :]), new_state)


def ssd_chunk(
    state: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    interpret: bool = False,
    config: SsdPallasConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One chunk of C tokens (Pallas GPU kernel; `interpret=True` runs it on CPU).

    Args:
      state: f32[H, P, N], the state before the chunk.
      x: f[C, H, P]; dt: f[C, H] steps (> 0, already softplus'ed and clamped); A: f[H] decay
        rates (< 0).
      B, C: f[C, G, N] (same dtype; float32 or bfloat16), G dividing H. Tokens with dt = 0, x = 0
        (padding) change nothing.
      interpret: run the kernel with the Pallas interpreter (CPU tests).
      config: tuning; None = `SsdPallasConfig()`.
    C, P and N must be powers of two >= 16 (`supported`).

    Returns:
      (y f32[C, H, P], state after the chunk f32[H, P, N]), as `ssd_chunk_reference` (the D skip
      is the caller's).
    """
    _check_inputs(state, x, dt, A, B, C)
    cfg = config or SsdPallasConfig()
    c, h, p = x.shape
    g, n = B.shape[1:]
    block_p = min(cfg.block_p, p)
    kernel = functools.partial(_kernel, chunk=c, n=n, block_p=block_p, heads_per_group=h // g)
    call = backend.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((c, h, p), jnp.float32),
            jax.ShapeDtypeStruct((h, p, n), jnp.float32),
        ],
        grid=(h, p // block_p),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
        name=f"ssd_chunk_c{c}_bp{block_p}",
    )
    y, new_state = call(state, x, dt, A, B, C)
    return y, new_state
