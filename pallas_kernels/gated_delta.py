"""The gated delta rule (Gated DeltaNet: Qwen3.5 / Qwen3-Next linear attention), in jnp.

Per value head, with state S f32[Dk, Dv], key k and query q (L2-normalized, q scaled by
Dk ** -0.5), value v, log-decay g <= 0 and write strength beta in (0, 1), one token does

    S <- exp(g) * S;   S <- S + k (beta * (v - S^T k))^T;   o = S^T q.

Three forms over the same math:
* `gated_delta_step`: one token for a batch of states (decode);
* `gated_delta_chunked`: one sequence in chunks of `chunk_size` tokens (the WY / UT-transform
  form: per chunk a unit-lower-triangular solve and matmuls instead of a rank-1 update per token,
  then one state carry per chunk);
* `gated_delta_packed`: the ragged step layout (many requests' tokens packed, `cu_q_lens`):
  rows with one token take the batched step, longer rows run the chunked form over their own
  tokens (a loop over rows and chunks whose trip counts are the real ones, so a short step does
  not pay for the token bucket's padding). Each row starts from its own initial state and hands
  back its final state; the caller reads / writes those from / to the state pages.
`gated_delta_reference` is the sequential token-by-token form (the oracle of the tests, beside a
float64 numpy twin in the tests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend, gated_delta_pallas
from pallas_kernels.backend import ChunkFn, ChunkImpl
from pallas_kernels.gated_delta_chunk import chunk_jnp as _chunk
from pallas_kernels.ragged_scan import chunked_scan, ragged_scan
from pallas_kernels.ragged_scan import initial_state as start_state

__all__ = [
    "GatedDeltaConfig",
    "gated_delta_chunked",
    "gated_delta_packed",
    "gated_delta_reference",
    "gated_delta_step",
    "l2norm",
]


@dataclasses.dataclass(frozen=True)
class GatedDeltaConfig:
    """Tuning: tokens per chunk of the chunked form (64 as in flash-linear-attention), and which
    implementation runs one chunk: "jnp" (`_chunk`, the default), "pallas" (the Triton kernel of
    `gated_delta_pallas`; interpret mode off GPU, and its shape limits: C, Dk, Dv powers of two
    >= 16) or "auto" (the kernel when `jax.default_backend() == "gpu"` and the shapes fit it,
    else jnp). jnp stays the default until the kernel is timed on a GPU against it
    (`benchmarks/device_e2e/recurrent.py`): it compiles for sm_90a but has never run on one."""

    chunk_size: int = 64
    chunk_impl: ChunkImpl = "jnp"

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        backend.check_chunk_impl(self.chunk_impl)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (flash-linear-attention's / HF's form)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _check(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, lead: int) -> None:
    """q, k f[*L, H, Dk]; v f[*L, H, Dv]; g, beta f[*L, H] with `lead` leading axes L."""
    if q.ndim != lead + 2 or q.shape != k.shape:
        raise ValueError(f"{q.shape=} {k.shape=}: q and k must both be [{lead} lead axes, H, Dk]")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"{v.shape=} must be {q.shape[:-1]} + (Dv,)")
    if g.shape != q.shape[:-1] or beta.shape != q.shape[:-1]:
        raise ValueError(f"{g.shape=} {beta.shape=} must both be {q.shape[:-1]}")


def gated_delta_step(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token per state: state f32[..., H, Dk, Dv], q k f[..., H, Dk], v f[..., H, Dv],
    g beta f[..., H] -> (new state, o f32[..., H, Dv])."""
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = jnp.einsum("...kv,...k->...v", state, k)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("...kv,...k->...v", state, q)


def _chunk_fn(config: GatedDeltaConfig, dk: int, dv: int) -> ChunkFn:
    """The one-chunk implementation `config.chunk_impl` picks for chunks of keys Dk, values Dv."""
    fits = gated_delta_pallas.supported(config.chunk_size, dk, dv)
    return backend.pick_chunk(config.chunk_impl, fits, _chunk, gated_delta_pallas.gated_delta_chunk)


def gated_delta_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    config: GatedDeltaConfig = GatedDeltaConfig(),
) -> tuple[jax.Array, jax.Array]:
    """One sequence: q k f[S, H, Dk], v f[S, H, Dv], g beta f[S, H], initial_state
    f32[H, Dk, Dv] (None = zeros) -> (o f32[S, H, Dv], final state f32[H, Dk, Dv])."""
    _check(q, k, v, g, beta, 1)
    h, dk, dv = q.shape[1], q.shape[2], v.shape[-1]
    state = start_state(initial_state, (h, dk, dv))
    chunk = _chunk_fn(config, dk, dv)
    return chunked_scan(lambda st, xs: chunk(st, *xs), (q, k, v, g, beta), state, config.chunk_size)


def gated_delta_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`gated_delta_chunked`'s contract, computed token by token (`gated_delta_step`)."""
    _check(q, k, v, g, beta, 1)
    h, dk, dv = q.shape[1], q.shape[2], v.shape[-1]
    state = start_state(initial_state, (h, dk, dv))
    xs = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
    state, out = lax.scan(lambda st, x: gated_delta_step(st, *x), state, xs)
    return out, state


def gated_delta_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_states: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    config: GatedDeltaConfig = GatedDeltaConfig(),
    align: jax.Array | None = None,
    snapshots: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Ragged step: q k f[T, H, Dk], v f[T, H, Dv], g beta f[T, H] (row r's tokens are
    [cu_q_lens[r], cu_q_lens[r+1])), initial_states f32[R, H, Dk, Dv], cu_q_lens i32[R+1],
    num_seqs i32[1] -> (o f32[T, H, Dv] (0 on padding), final states f32[R, H, Dk, Dv]: a row
    without tokens keeps its initial state, the snapshot pool f32[P, H, Dk, Dv] or None).
    align i32[R] / snapshots (pool, pages i32[T]): state snapshots at page ends
    (`ragged_scan`)."""
    _check(q, k, v, g, beta, 1)
    t, h, dk = q.shape
    dv = v.shape[-1]
    r = initial_states.shape[0]
    if initial_states.shape != (r, h, dk, dv):
        raise ValueError(f"{initial_states.shape=} must be [R, {h}, {dk}, {dv}]")

    def step(states: jax.Array, xs: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
        return gated_delta_step(states, *xs)

    chunk_impl = _chunk_fn(config, dk, dv)

    def chunk(state: jax.Array, xs: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
        return chunk_impl(state, *xs)

    return ragged_scan(
        step, chunk, (q, k, v, g, beta), initial_states, cu_q_lens, num_seqs, (h, dv),
        config.chunk_size, align, snapshots,
    )  # fmt: skip
