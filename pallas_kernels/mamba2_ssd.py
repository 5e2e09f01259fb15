"""The Mamba2 selective state-space recurrence ("SSD": Bamba / GraniteMoeHybrid mixers), in jnp.

Per head h (group g = h // (H // G)), with state s f32[P, N], input x f32[P], step dt > 0
(softplus'ed, biased and clamped by the caller), decay rate A[h] < 0 and B, C f[N] of group g,
one token does

    s <- exp(dt * A) * s + dt * x B^T;   y = s C      (the D skip is the caller's).

Three forms over the same math:
* `ssd_step`: one token for a batch of states (decode);
* `ssd_chunked`: one sequence in chunks of `chunk_size` tokens (the state-space-duality form: per
  chunk a masked, decayed C B^T "attention" over the chunk's tokens plus the carried state read
  through C, then one state carry per chunk);
* `ssd_packed`: the ragged step layout (many requests' tokens packed, `cu_q_lens`): rows with one
  token take the batched step, longer rows run the chunked form over their own tokens (a loop over
  rows and chunks whose trip counts are the real ones). Each row starts from its own initial state
  and hands back its final state; the caller reads / writes those from / to the state pages.
`ssd_reference` is the sequential token-by-token form (the oracle of the tests, beside a float64
numpy twin in the tests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend, mamba2_ssd_pallas
from pallas_kernels.backend import ChunkFn, ChunkImpl
from pallas_kernels.mamba2_ssd_chunk import chunk_jnp as _chunk
from pallas_kernels.mamba2_ssd_chunk import heads
from pallas_kernels.ragged_scan import chunked_scan, ragged_scan
from pallas_kernels.ragged_scan import initial_state as start_state

__all__ = ["Mamba2Config", "ssd_chunked", "ssd_packed", "ssd_reference", "ssd_step"]


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """Tuning: tokens per chunk of the chunked form, and which implementation runs one chunk:
    "jnp" (`mamba2_ssd_chunk.chunk_jnp`, the default), "pallas" (the Triton kernel of
    `mamba2_ssd_pallas`; interpret mode off GPU; C, P, N powers of two >= 16) or "auto" (the
    kernel on a GPU where the shapes fit it). jnp stays the default until the kernel is timed on a
    GPU against it: it compiles for sm_90a but has never run on one."""

    chunk_size: int = 64
    chunk_impl: ChunkImpl = "jnp"

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        backend.check_chunk_impl(self.chunk_impl)


def _chunk_fn(config: Mamba2Config, p: int, n: int) -> ChunkFn:
    """The one-chunk implementation `config.chunk_impl` picks for head dim P, state size N."""
    fits = mamba2_ssd_pallas.supported(config.chunk_size, p, n)
    return backend.pick_chunk(config.chunk_impl, fits, _chunk, mamba2_ssd_pallas.ssd_chunk)


def _check(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, lead: int) -> None:
    """x f[*L, H, P]; dt f[*L, H]; A f[H]; B, C f[*L, G, N] with `lead` leading axes L, G | H."""
    if x.ndim != lead + 2:
        raise ValueError(f"{x.shape=} must be [{lead} lead axes, H, P]")
    if dt.shape != x.shape[:-1]:
        raise ValueError(f"{dt.shape=} must be {x.shape[:-1]}")
    if A.shape != x.shape[-2:-1]:
        raise ValueError(f"{A.shape=} must be ({x.shape[-2]},)")
    if B.ndim != lead + 2 or B.shape != C.shape or B.shape[:-2] != x.shape[:-2]:
        raise ValueError(f"{B.shape=} {C.shape=} must both be {x.shape[:-2]} + (G, N)")
    if B.shape[-2] < 1 or x.shape[-2] % B.shape[-2]:
        raise ValueError(f"{B.shape=}: the group count must divide the {x.shape[-2]} heads")


def ssd_step(
    state: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token per state: state f32[..., H, P, N], x f[..., H, P], dt f[..., H], A f[H],
    B C f[..., G, N] -> (new state, y f32[..., H, P])."""
    _check(x, dt, A, B, C, x.ndim - 2)
    if state.shape != x.shape + B.shape[-1:]:
        raise ValueError(f"{state.shape=} must be {x.shape + B.shape[-1:]}")
    h = x.shape[-2]
    x, dt, A = (v.astype(jnp.float32) for v in (x, dt, A))
    bh, ch = heads(B, h), heads(C, h)
    state = state.astype(jnp.float32) * jnp.exp(dt * A)[..., None, None]
    state = state + (dt[..., None] * x)[..., :, None] * bh[..., None, :]
    return state, jnp.einsum("...pn,...n->...p", state, ch)


def ssd_chunked(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    initial_state: jax.Array | None = None,
    config: Mamba2Config = Mamba2Config(),
) -> tuple[jax.Array, jax.Array]:
    """One sequence: x f[S, H, P], dt f[S, H], A f[H], B C f[S, G, N], initial_state f32[H, P, N]
    (None = zeros) -> (y f32[S, H, P], final state f32[H, P, N])."""
    _check(x, dt, A, B, C, 1)
    a = A.astype(jnp.float32)
    state = start_state(initial_state, (x.shape[1], x.shape[2], B.shape[-1]))
    impl = _chunk_fn(config, x.shape[2], B.shape[-1])

    def chunk(state: jax.Array, xs: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
        xc, dtc, bc, cc = xs
        return impl(state, xc, dtc, a, bc, cc)

    return chunked_scan(chunk, (x, dt, B, C), state, config.chunk_size)


def ssd_reference(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`ssd_chunked`'s contract, computed token by token (`ssd_step`)."""
    _check(x, dt, A, B, C, 1)
    h, p, n = x.shape[1], x.shape[2], B.shape[-1]
    state = start_state(initial_state, (h, p, n))
    xs = tuple(v.astype(jnp.float32) for v in (x, dt, B, C))
    A = A.astype(jnp.float32)

    def body(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        xt, dtt, bt, ct = xs
        return ssd_step(state, xt, dtt, A, bt, ct)

    state, y = lax.scan(body, state, xs)
    return y, state


def ssd_packed(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    initial_states: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    config: Mamba2Config = Mamba2Config(),
    align: jax.Array | None = None,
    snapshots: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Ragged step: x f[T, H, P], dt f[T, H], A f[H], B C f[T, G, N] (row r's tokens are
    [cu_q_lens[r], cu_q_lens[r+1])), initial_states f32[R, H, P, N], cu_q_lens i32[R+1],
    num_seqs i32[1] -> (y f32[T, H, P] (0 on padding), final states f32[R, H, P, N]: a row
    without tokens keeps its initial state, the snapshot pool f32[P, H, P, N] or None).
    align i32[R] / snapshots (pool, pages i32[T]): state snapshots at page ends
    (`ragged_scan`)."""
    _check(x, dt, A, B, C, 1)
    t, h, p = x.shape
    n = B.shape[-1]
    r = initial_states.shape[0]
    if initial_states.shape != (r, h, p, n):
        raise ValueError(f"{initial_states.shape=} must be [R, {h}, {p}, {n}]")
    a = A.astype(jnp.float32)

    def step(states: jax.Array, xs: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
        x1, dt1, b1, c1 = xs
        return ssd_step(states, x1, dt1, a, b1, c1)

    impl = _chunk_fn(config, p, n)

    def chunk(state: jax.Array, xs: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
        xc, dtc, bc, cc = xs
        return impl(state, xc, dtc, a, bc, cc)

    return ragged_scan(
        step, chunk, (x, dt, B, C), initial_states, cu_q_lens, num_seqs, (h, p), config.chunk_size,
        align, snapshots,
    )  # fmt: skip
