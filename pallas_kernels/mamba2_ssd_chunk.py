"""One chunk of the Mamba2 SSD recurrence in jnp (the state-space-duality form), in its own module
so that `mamba2_ssd` (the drivers, which pick jnp or the kernel) and `mamba2_ssd_pallas` (whose
reference `chunk_jnp` is) both import it, not each other."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_chunk import segment_decays

__all__ = ["chunk_jnp", "heads"]


def heads(b: jax.Array, h: int) -> jax.Array:
    """B or C f[..., G, N] -> f32[..., H, N]: each group repeated onto its H // G heads."""
    return jnp.repeat(b.astype(jnp.float32), h // b.shape[-2], axis=-2)


def chunk_jnp(
    state: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One chunk of c tokens from `state` f32[H, P, N]: x f32[c, H, P], dt f32[c, H], A f32[H],
    B C f32[c, G, N] -> (y f32[c, H, P], state after the chunk). Tokens with dt = 0, x = 0
    (padding) change nothing."""
    h = dt.shape[1]
    bh, ch = heads(B, h), heads(C, h)  # [c, H, N]
    # per head, the log-decays a_i = dt_i A: cum through token i, seg from token j to i (summed
    # directly, not as cum_i - cum_j: dt * A reaches -100 and below per token)
    cum, seg, decay = segment_decays((dt * A).T.astype(jnp.float32))  # [H, c], [H, c, c] x 2
    xdt = x.astype(jnp.float32) * dt[..., None]  # [c, H, P]
    scores = jnp.einsum("ihn,jhn->hij", ch, bh) * decay
    intra = jnp.einsum("hij,jhp->ihp", scores, xdt)
    inter = jnp.einsum("hpn,ihn->ihp", state, ch) * jnp.exp(cum).T[..., None]
    tail = jnp.exp(seg[:, -1, :]).T  # [c, H]: decay from token j to the chunk end
    state = state * jnp.exp(cum[:, -1])[:, None, None]
    state = state + jnp.einsum("jhp,jhn->hpn", xdt * tail[..., None], bh)
    return intra + inter, state
