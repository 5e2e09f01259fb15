"""One chunk of the gated delta rule in jnp (the WY / UT-transform form), and the two pieces of
it the Pallas kernel (`gated_delta_pallas`) shares: the segment decays and the matmul-only
inverse. Its own module so that `gated_delta` (the drivers, which pick jnp or the kernel) and
`gated_delta_pallas` (whose reference `chunk_jnp` is) both import it, not each other."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["chunk_jnp", "segment_decays", "unit_lower_inverse"]

Matmul = Callable[[jax.Array, jax.Array], jax.Array]


def unit_lower_inverse(n: jax.Array, matmul: Matmul = jnp.matmul) -> jax.Array:
    """(I + N)^-1 for strictly lower-triangular N f32[..., C, C]: N is nilpotent, so the inverse
    is the finite series sum_i (-N)^i = (I - N)(I + N^2)(I + N^4)... (log2 C matmuls). Matmuls
    only: no LAPACK call (whose CPU kernel is bound lazily at lowering, so an executable read
    back from the executable cache would call through a null pointer) and no sequential solve.
    `matmul`: the Pallas kernel passes its float32 (IEEE, not TF32) in-kernel dot."""
    c = n.shape[-1]
    eye = jnp.eye(c, dtype=n.dtype)
    inv, power = eye - n, matmul(n, n)
    span = 2
    while span < c:  # static: C is a shape
        inv = inv + matmul(inv, power)
        power, span = matmul(power, power), 2 * span
    return inv


def segment_decays(g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-decays g f32[..., C] of one chunk -> (cum f32[..., C]: log of the decay from the chunk
    start through token i; seg f32[..., C(i), C(j)]: g_{j+1} + ... + g_i below the diagonal, 0 on
    and above it; decay = exp(seg) on and below the diagonal, 0 above). Shared with the Pallas
    kernel (`gated_delta_pallas`), which calls it on one head's [C]."""
    c = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    # seg[i, j] = g_{j+1} + ... + g_i, summed directly: cum_i - cum_j cancels catastrophically once
    # the chunk's decays add up to hundreds (real gates reach g = -90), losing ~1e-4 of each decay.
    seg = jnp.cumsum(jnp.where(strict, g[..., :, None], 0.0), axis=-2)
    decay = jnp.where(lower, jnp.exp(seg), 0.0)
    return cum, seg, decay


def chunk_jnp(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One chunk of C tokens from `state` f32[H, Dk, Dv]: q k f32[C, H, Dk], v f32[C, H, Dv],
    g beta f32[C, H] -> (o f32[C, H, Dv], state after the chunk). Tokens with k = v = 0,
    beta = 0, g = 0 (padding) change nothing."""
    q, k, v = (x.transpose(1, 0, 2) for x in (q, k, v))  # [H, C, D]
    g, beta = g.T, beta.T  # [H, C]
    c = q.shape[1]
    cum, seg, decay = segment_decays(g)  # [H, C], [H, C(i), C(j)] x 2
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    kb, vb = k * beta[..., None], v * beta[..., None]
    system = jnp.where(strict, (kb @ k.transpose(0, 2, 1)) * decay, 0.0)  # the UT transform's N
    inv = unit_lower_inverse(system)
    u = inv @ vb
    w = inv @ (kb * jnp.exp(cum)[..., None])
    v_new = u - w @ state  # the part of each write the carried state does not already predict
    intra = (q @ k.transpose(0, 2, 1)) * decay
    out = (q * jnp.exp(cum)[..., None]) @ state + intra @ v_new
    k_tail = k * jnp.exp(seg[:, -1, :])[..., None]  # decay from token j to the chunk end
    state = state * jnp.exp(cum[:, -1])[:, None, None] + k_tail.transpose(0, 2, 1) @ v_new
    return out.transpose(1, 0, 2), state
