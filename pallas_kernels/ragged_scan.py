"""The ragged (packed) driver every chunked linear recurrence shares (gated delta rule, Mamba2 SSD).

A packed step holds R rows; row r owns tokens [cu_q_lens[r], cu_q_lens[r+1]) and starts from
initial_states[r]. Rows of one token (decode) take one batched `step`; longer rows run `chunk`
over their own tokens, one fixed-size chunk at a time, in loops whose trip counts are the real
ones. A token outside its row (another row's, padding) enters a chunk as zeros, which both
recurrences treat as the identity (no decay, no write), so a chunk never needs its row to fill it.

Page snapshots: with `align`, row r's chunks start `align[r]` tokens before its first token, so
chunk ends fall on multiples of the chunk size in position space (the caller picks a chunk size
dividing its page size and align = first position % chunk); with `snapshots` = (pool f32[P, ...],
pages i32[T]), the state after token t is written to pool[pages[t]] (pages[t] = P: none), so a
row leaves a state snapshot at every page end it crosses, not only at its last token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

StepFn = Callable[[jax.Array, Sequence[jax.Array]], tuple[jax.Array, jax.Array]]  # (state, out)
ChunkFn = Callable[[jax.Array, Sequence[jax.Array]], tuple[jax.Array, jax.Array]]  # (out, state)


def initial_state(state: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    """The float32 starting state of one sequence: `state`, or zeros of `shape` when None."""
    return jnp.zeros(shape, jnp.float32) if state is None else state.astype(jnp.float32)


def chunked_scan(
    chunk: ChunkFn, xs: Sequence[jax.Array], state: jax.Array, chunk_size: int
) -> tuple[jax.Array, jax.Array]:
    """One sequence through `chunk` in chunks of `chunk_size`: xs per-token inputs f[S, ...]
    (zero-padded to a whole number of chunks: the identity for both recurrences), state f32[...]
    -> (out f32[S, ...], final state)."""
    s, c = xs[0].shape[0], chunk_size
    pad = -s % c
    m = (s + pad) // c
    chunks = [
        jnp.pad(x.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(m, c, *x.shape[1:])
        for x in xs
    ]

    def body(state: jax.Array, pieces: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        out, state = chunk(state, pieces)
        return state, out

    state, out = lax.scan(body, state, chunks)
    return out.reshape(m * c, *out.shape[2:])[:s], state


def ragged_scan(
    step: StepFn,
    chunk: ChunkFn,
    xs: Sequence[jax.Array],
    initial_states: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    out_tail: tuple[int, ...],
    chunk_size: int,
    align: jax.Array | None = None,
    snapshots: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """xs: per-token inputs f[T, ...]; initial_states f32[R, ...]; out_tail: the trailing shape of
    one token's output. step(states f32[R, ...], per-row token inputs) -> (states, out f32[R,
    *out_tail]); chunk(state, chunk inputs f32[c, ...]) -> (out f32[c, *out_tail], state).
    Returns (out f32[T, *out_tail] (0 on padding), final states f32[R, ...] (a row without tokens
    keeps its initial state), the snapshot pool or None)."""
    t, r, c = xs[0].shape[0], initial_states.shape[0], chunk_size
    if cu_q_lens.shape != (r + 1,) or num_seqs.shape != (1,):
        raise ValueError(f"{cu_q_lens.shape=} must be ({r + 1},), {num_seqs.shape=} must be (1,)")
    xs = [x.astype(jnp.float32) for x in xs]
    starts = cu_q_lens[:-1]
    lens = jnp.where(jnp.arange(r) < num_seqs[0], cu_q_lens[1:] - starts, 0)
    offs = jnp.zeros((r,), jnp.int32) if align is None else jnp.where(lens > 1, align, 0)
    states = initial_states.astype(jnp.float32)
    pool, pages = snapshots if snapshots is not None else (None, None)

    def expand(m: jax.Array, x: jax.Array) -> jax.Array:  # a row / token mask broadcast onto x
        return m.reshape(m.shape + (1,) * (x.ndim - m.ndim))

    # Rows of one token: one batched step (a decode step is only this).
    one = lens == 1
    at = jnp.clip(starts, 0, t - 1)
    stepped, o1 = step(states, [x[at] for x in xs])
    states = jnp.where(expand(one, states), stepped, states)
    out = jnp.zeros((t, *out_tail), jnp.float32).at[jnp.where(one, starts, t)].set(o1, mode="drop")
    if pool is not None and pages is not None:
        pool = pool.at[jnp.where(one, pages[at], pool.shape[0])].set(stepped, mode="drop")

    # Longer rows: the chunked form over each row's own tokens. The packed inputs get a chunk of
    # zeros on both sides so a chunk's fixed-size slice never runs off either end (dynamic_slice
    # would clamp, i.e. shift, it).
    padded = [jnp.pad(x, [(c, c)] + [(0, 0)] * (x.ndim - 1)) for x in xs]
    out = jnp.pad(out, [(c, c)] + [(0, 0)] * len(out_tail))
    snap_pages = None
    if pool is not None and pages is not None:
        snap_pages = jnp.pad(pages, (c, c), constant_values=pool.shape[0])

    Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]

    def chunk_body(row: jax.Array, carry: Carry) -> Carry:
        j, state, out, pool = carry
        begin = c + starts[row] - offs[row] + j * c  # in padded coordinates
        u = j * c - offs[row] + jnp.arange(c)  # index in the row of each chunk token
        live = (u >= 0) & (u < lens[row])
        pieces = [lax.dynamic_slice_in_dim(x, begin, c) for x in padded]
        o, state = chunk(state, [jnp.where(expand(live, x), x, 0.0) for x in pieces])
        old = lax.dynamic_slice_in_dim(out, begin, c)
        out = lax.dynamic_update_slice_in_dim(out, jnp.where(expand(live, o), o, old), begin, 0)
        if pool is not None and snap_pages is not None:
            last = jnp.minimum(lens[row], (j + 1) * c - offs[row]) - 1  # the chunk's last live token
            page = snap_pages[c + starts[row] + last]
            pool = pool.at[page].set(state, mode="drop")
        return j + 1, state, out, pool

    RowCarry = tuple[jax.Array, jax.Array, jax.Array | None]

    def row_body(row: jax.Array, carry: RowCarry) -> RowCarry:
        states, out, pool = carry
        n_chunks = jnp.where(lens[row] > 1, -(-(lens[row] + offs[row]) // c), 0)
        _, state, out, pool = lax.while_loop(
            lambda cy: cy[0] < n_chunks,
            lambda cy: chunk_body(row, cy),
            (jnp.int32(0), states[row], out, pool),
        )
        return states.at[row].set(state), out, pool

    states, out, pool = lax.fori_loop(0, num_seqs[0], row_body, (states, out, pool))
    return out[c : c + t], states, pool
