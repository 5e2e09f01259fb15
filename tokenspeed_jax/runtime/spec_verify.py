"""On-device verification of speculative drafts (n-gram speculation, `scheduler.speculative`).

A speculative row's query tokens end with its last known token then d drafts (`StepOps.
draft_lens`). The model's output at each of those d + 1 positions is a next-token distribution
p_j; draft j + 1 is checked against p_j, left to right:

  - greedy (temperature 0): accepted iff it is p_j's argmax;
  - sampled: the row draws x_j ~ p_j with the very key an ordinary row would use for that output
    index (fold_in(PRNGKey(seed), sample_index + j)), and the draft is accepted iff x_j equals it.
    That is speculative sampling for a deterministic proposer (whose q is one-hot at the draft):
    the draft is accepted with probability p_j(draft) = min(1, p / q), and on rejection x_j is
    a draw from p_j without the draft, renormalised. Drawing with the ordinary key couples the
    two runs: a seeded request emits the same tokens with speculation as without.

The row's accepted count a is the length of the leading run of accepted drafts, and its token is
x_a (a correction, or the bonus token after all d drafts), so every emitted token follows the
target distribution exactly. p_j is the row's filtered distribution
(temperature, top-k, top-p); rows with penalties, logit_bias, logprobs or a grammar never carry
drafts (the scheduler and engine keep them out).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from tokenspeed_jax.runtime.device_ops import DeviceOps
from tokenspeed_jax.runtime.draw import draw, row_keys
from tokenspeed_jax.runtime.filtering import filtered_logits

__all__ = ["verify_drafts"]


def verify_drafts(
    hidden: jax.Array,
    ops: DeviceOps,
    n: int,
    k: int,
    lm_head: Callable[[jax.Array], jax.Array],
    gather_logits: Callable[[jax.Array], jax.Array] | None = None,
    greedy_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Verify the drafts of the first n rows (k = the most drafts a row may carry, static).

    hidden f[T, H] the model's last hidden states; ops: the step's unpacked StepOps arrays
    (`draft_lens`, `cu_q_lens`, `token_ids` resolved, sampling columns). Returns (tokens i32[n]:
    each row's token after its accepted drafts, accepted i32[n]: its accepted draft count);
    rows without drafts get their ordinary sample (greedy or drawn at sample_index).
    greedy_ids i32[T] (optional): the argmax of every token's logits, already computed by the
    caller (`sampling.sample_rows` on a small bucket); the LM head then runs here only on steps
    that sample."""
    t = hidden.shape[0]
    d = ops.draft_lens[:n]
    j = jnp.arange(k + 1, dtype=jnp.int32)
    # positions of the row's last known token (j = 0) and its drafts; clipped past the row's end
    # (those columns are never used)
    first = ops.cu_q_lens[1 : n + 1] - 1 - d
    idx = jnp.clip(first[:, None] + jnp.minimum(j[None, :], d[:, None]), 0, t - 1)

    def head_at_idx() -> jax.Array:  # the logits at idx: [n (k + 1), V]
        rows = lm_head(hidden[idx.reshape(-1)])
        return rows if gather_logits is None else gather_logits(rows)

    grid: Callable[[], jax.Array]
    if greedy_ids is not None:  # a small bucket: the caller ran the head over every token
        greedy = greedy_ids[idx]
        grid = head_at_idx  # the logits only on steps that sample (the cond below)
    else:  # a bigger bucket: the head over the [n, k + 1] grid of positions only
        every = head_at_idx()
        greedy = jnp.argmax(every, axis=-1).astype(jnp.int32).reshape(n, k + 1)
        grid = lambda: every
    drafts = ops.token_ids[jnp.clip(idx + 1, 0, t - 1)]  # the draft after position j
    is_draft = j[None, :] < d[:, None]
    temperature = ops.temperature[:n]

    def sampled(_):
        def per_row(x):
            return jnp.repeat(x[:n], k + 1)

        flat = filtered_logits(
            grid().astype(jnp.float32), per_row(temperature), per_row(ops.top_k), per_row(ops.top_p)
        )
        # position j draws with the key an ordinary row sampling output index sample_index + j
        # would use (`sampling.sample`), so the drawn token is the one decoding without drafts
        # would have drawn there
        index = (ops.sample_index[:n, None] + j[None, :]).reshape(-1)
        drawn = draw(row_keys(per_row(ops.seeds), index), flat).reshape(n, k + 1)
        return jnp.where(temperature[:, None] > 0, drawn, greedy)

    out = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)
    accept = out == drafts
    run = jnp.cumprod((accept & is_draft).astype(jnp.int32), axis=1)
    accepted = run.sum(axis=1).astype(jnp.int32)
    tokens = jnp.take_along_axis(out, accepted[:, None], axis=1)[:, 0]
    return tokens, accepted
