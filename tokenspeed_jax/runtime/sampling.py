"""On-device sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs, penalties.

A row's random key is `fold_in(PRNGKey(seed), sample_index)`: it depends only on the request's
seed and how many tokens it has generated, so a seed reproduces the same tokens whatever else is
in the batch (and after retraction / resume). Logprobs come from the unmodified log-softmax of
the model's logits (before penalties / bias / temperature / top-k / top-p), as vLLM reports them.

Penalties (OpenAI / vLLM semantics, applied before temperature): logit_bias is added first; then
repetition_penalty r divides positive logits by r and multiplies negative ones by r for every token
seen in the prompt or the output; then `logit -= frequency * count + presence * (count > 0)` with
`count` = occurrences of the token in the generated output. The per-slot counts live on the device
(`PenaltyState`) and are rebuilt from the step's own input tokens (see `update_penalty_state`).

Structured outputs: after the penalties, tokens outside a row's grammar bitmask (host-computed,
`structured.GrammarBook`) are set to -inf (`apply_token_mask`), so greedy, temperature, top-k /
top-p all sample from the allowed tokens; logprobs stay those of the unmodified model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tokenspeed_jax.runtime.device_ops import DeviceOps
from tokenspeed_jax.runtime.draw import draw, row_keys
from tokenspeed_jax.runtime.filtering import filtered_logits
from tokenspeed_jax.runtime.spec_verify import verify_drafts

__all__ = [
    "MAX_TOP_LOGPROBS",
    "PenaltyState",
    "apply_penalties",
    "apply_token_mask",
    "filtered_logits",
    "init_penalty_state",
    "penalize_step",
    "prompt_logprobs",
    "sample",
    "sample_rows",
    "top_logprobs",
    "update_penalty_state",
]

MAX_TOP_LOGPROBS = 20  # K of the on-device top-k logprobs (OpenAI's top_logprobs limit)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    sample_index: jax.Array,
    raw_logits: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row.

    logits f32[R, V]; temperature f32[R] (0 = greedy); top_k i32[R] (-1 = all); top_p f32[R] in
    (0, 1]; seeds u32[R]; sample_index i32[R] (tokens generated so far).
    raw_logits f32[R, V] (optional): the logits before penalties / bias; logprobs come from these
    when given (else from `logits`).
    Returns (tokens i32[R], logprobs f32[R] = log_softmax(raw_logits)[token]).
    The sort-based filtering runs only on steps where some row samples (lax.cond), so all-greedy
    steps pay for an argmax alone.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic(_):
        filtered = filtered_logits(logits, temperature, top_k, top_p)
        drawn = draw(row_keys(seeds, sample_index), filtered)
        return jnp.where(temperature > 0, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda _: greedy, None)
    logp = jax.nn.log_softmax((logits if raw_logits is None else raw_logits).astype(jnp.float32), axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def prompt_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log_softmax(logits[t])[targets[t]] per token; NaN where targets[t] < 0 (none / padding).

    logits f32[T, V]; targets i32[T]. Returns f32[T].
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(targets >= 0, picked, jnp.nan)


def top_logprobs(logits: jax.Array, k: int = MAX_TOP_LOGPROBS) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens of each row and their log-softmax values, descending.

    logits f32[R, V]. Returns (ids i32[R, k], logprobs f32[R, k]); k is static (one compile)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logp, min(k, logits.shape[-1]))
    return ids.astype(jnp.int32), values


class PenaltyState(NamedTuple):
    """Per device slot token statistics for the penalties (S = max_live_requests, V = vocab).

    counts i32[S, V]: occurrences of each token among the request's generated tokens so far.
    seen bool[S, V]: the token occurs in the request's prompt (repetition penalty)."""

    counts: jax.Array
    seen: jax.Array


def init_penalty_state(num_slots: int, vocab_size: int) -> PenaltyState:
    return PenaltyState(
        jnp.zeros((num_slots, vocab_size), jnp.int32), jnp.zeros((num_slots, vocab_size), bool)
    )


def update_penalty_state(
    state: PenaltyState, req_slots, kv_lens, cu_q_lens, prompt_lens, token_ids, positions, token_rows
) -> PenaltyState:
    """Fold one step's input tokens into the slots' statistics.

    Requests with penalties never take a prefix-cache hit, so every token they hold passes
    through a step as an input (a sampled token is the next step's input): a row whose first
    query token sits at position 0 starts its slot afresh, then each input token counts as
    generated (position >= prompt_lens[row]) or marks the prompt set. Everything before a row's
    sampling point is therefore counted exactly when that row samples. Padding rows (slot -1)
    and padding tokens (row R) are dropped (scatter index = dimension size, mode="drop").

    req_slots i32[R]; kv_lens i32[R]; cu_q_lens i32[R+1]; prompt_lens i32[R];
    token_ids, positions, token_rows i32[T].
    """
    s, v = state.counts.shape
    r = req_slots.shape[0]
    starts_fresh = (req_slots >= 0) & (kv_lens - (cu_q_lens[1:] - cu_q_lens[:-1]) == 0)
    reset = jnp.where(starts_fresh, req_slots, s)
    counts = state.counts.at[reset].set(0, mode="drop")
    seen = state.seen.at[reset].set(False, mode="drop")
    valid = token_rows < r
    row = jnp.minimum(token_rows, r - 1)
    slot = jnp.where(valid, req_slots[row], -1)
    slot = jnp.where(slot >= 0, slot, s)  # padding -> out of range, dropped
    generated = positions >= prompt_lens[row]
    counts = counts.at[jnp.where(generated, slot, s), token_ids].add(1, mode="drop")
    seen = seen.at[jnp.where(generated, s, slot), token_ids].set(True, mode="drop")
    return PenaltyState(counts, seen)


def apply_penalties(logits, counts, seen, presence, frequency, repetition, bias_ids, bias_values):
    """Logits after logit_bias, repetition, frequency and presence penalties (module docstring).

    logits f32[R, V]; counts i32[R, V] (generated-token counts of each row's request); seen
    bool[R, V] (token in the prompt); presence, frequency f32[R] (0 = off); repetition f32[R]
    (1 = off); bias_ids i32[R, B] (-1 padding); bias_values f32[R, B]. Returns f32[R, V].
    """
    r, v = logits.shape
    logits = logits.astype(jnp.float32)
    rows = jnp.broadcast_to(jnp.arange(r)[:, None], bias_ids.shape)
    logits = logits.at[rows, jnp.where(bias_ids >= 0, bias_ids, v)].add(bias_values, mode="drop")
    occurred = counts > 0
    rep = repetition[:, None]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(occurred | seen, penalized, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * occurred


def penalize_step(penalties: PenaltyState, logits: jax.Array, ops: DeviceOps):
    """One step's penalty work: (state after this step's inputs, logits f32[n, V] after bias and
    penalties; logits are the first n <= R rows). `ops` holds the step's StepOps arrays
    (req_slots, kv_lens, cu_q_lens, prompt_lens, token_ids, positions, token_rows and the
    penalty / logit_bias fields). Both
    parts run under lax.cond, so steps without penalties or logit_bias pay nothing for them."""
    use = (ops.presence_penalty != 0) | (ops.frequency_penalty != 0) | (ops.repetition_penalty != 1)
    penalties = jax.lax.cond(
        jnp.any(use),
        lambda p: update_penalty_state(
            p,
            ops.req_slots,
            ops.kv_lens,
            ops.cu_q_lens,
            ops.prompt_lens,
            ops.token_ids,
            ops.positions,
            ops.token_rows,
        ),
        lambda p: p,
        penalties,
    )
    if penalties.counts.shape[-1] != logits.shape[-1]:
        raise ValueError(f"penalty state vocab {penalties.counts.shape[-1]} != logits {logits.shape[-1]}")

    n = logits.shape[0]  # the runner may run the LM head on the first n <= R rows only

    def modify(x):
        slots = jnp.maximum(ops.req_slots[:n], 0)
        counts = jnp.where(use[:n, None], penalties.counts[slots], 0)
        seen = use[:n, None] & penalties.seen[slots]
        return apply_penalties(
            x,
            counts,
            seen,
            ops.presence_penalty[:n],
            ops.frequency_penalty[:n],
            ops.repetition_penalty[:n],
            ops.logit_bias_ids[:n],
            ops.logit_bias_values[:n],
        )

    active = jnp.any(use) | jnp.any(ops.logit_bias_ids >= 0)
    return penalties, jax.lax.cond(active, modify, lambda x: x.astype(jnp.float32), logits)


def apply_token_mask(logits: jax.Array, words: jax.Array) -> jax.Array:
    """logits f32[n, V] with every token whose bit is clear in words i32[n, ceil(V / 32)]
    (bit t % 32 of word t // 32, llguidance's layout) set to -inf."""
    v = logits.shape[-1]
    ids = jnp.arange(v, dtype=jnp.int32)
    gathered = words[:, ids // 32]
    bits = jax.lax.shift_right_logical(gathered, jnp.broadcast_to(ids % 32, gathered.shape)) & 1
    return jnp.where(bits != 0, logits, -jnp.inf)


def sample_rows(
    hidden: jax.Array,
    ops: DeviceOps,
    penalties: PenaltyState,
    last_tokens: jax.Array,
    *,
    lm_head: Callable[[jax.Array], jax.Array],
    max_rows: int,
    gather_logits: Callable[[jax.Array], jax.Array] | None = None,
    token_mask: jax.Array | None = None,
    num_speculative: int = 0,
) -> tuple[PenaltyState, jax.Array, jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array], jax.Array]:
    """One step's sampling tail, inside the jit: penalties, sampling, top-k and prompt logprobs.

    hidden f[T, H]: the model's last hidden states; ops: the step's unpacked StepOps arrays
    (R = `max_rows` rows); last_tokens i32[S]: each slot's last sampled token. `lm_head` maps
    hidden f[N, H] -> logits f[N, V]; `gather_logits` (tensor parallel) makes vocab-sharded row
    logits whole before the sort / argmax. token_mask i32[R, ceil(V / 32)] (optional): allowed
    tokens per row (all bits set = unconstrained); applied only on steps where some row is
    constrained (lax.cond). num_speculative: k > 0 verifies the drafts of rows with
    `draft_lens` > 0 (`spec_verify.verify_drafts`, only on steps that carry drafts: lax.cond).
    Returns (penalty state after the step, last_tokens i32[S] with each sampling row's token
    stored at its slot, tokens i32[R] (-1 where `sample_mask` is off), logprobs f32[R] (NaN
    there), prompt logprobs f32[T] (NaN where `prompt_targets` < 0), (top ids i32[R, K], top
    logprobs f32[R, K]) with K = min(MAX_TOP_LOGPROBS, V), -1 / NaN on rows that sample nothing,
    accepted i32[R]: drafts each row accepted (0 without drafts); a speculative row's token is
    the one after its accepted drafts).
    """
    t = hidden.shape[0]
    # A step has at most one row per token, so rows >= min(R, T) are padding: the LM head and
    # the sampler only run on the first n rows (a 16-token decode bucket pays for 16, not R).
    n = min(max_rows, t)
    rows = ops.first_rows(n)
    last = jnp.clip(ops.cu_q_lens[1 : n + 1] - 1, 0, t - 1)  # each row's last token

    def head(h: jax.Array) -> jax.Array:  # whole-vocabulary logits of hidden rows h
        out = lm_head(h)
        return out if gather_logits is None else gather_logits(out)

    def row_logits(h: jax.Array) -> jax.Array:
        return head(h[last])

    greedy_ids = None
    if num_speculative and t <= n * (num_speculative + 1):
        # A small bucket that carries drafts: verification needs the LM head over every token
        # of the step (`spec_verify`), the rows' own logits are among them, so the head runs
        # once, over the t tokens, not over t + n rows; the drafts' greedy check then reads
        # argmax ids (i32[t]). Steps without drafts keep the head over their n rows.
        def every_token(h: jax.Array) -> tuple[jax.Array, jax.Array]:
            every = head(h)
            return every[last], jnp.argmax(every, axis=-1).astype(jnp.int32)

        logits, greedy_ids = jax.lax.cond(
            jnp.any(ops.draft_lens[:n] > 0),
            every_token,
            lambda h: (row_logits(h), jnp.zeros((t,), jnp.int32)),
            hidden,
        )
    else:
        logits = row_logits(hidden)
    penalties, processed = penalize_step(penalties, logits, ops)
    if token_mask is not None:
        words = token_mask[:n]
        processed = jax.lax.cond(jnp.any(words != -1), apply_token_mask, lambda x, _: x, processed, words)
    tokens, logprobs = sample(
        processed, rows.temperature, rows.top_k, rows.top_p,
        rows.seeds, rows.sample_index, raw_logits=logits,
    )  # fmt: skip
    accepted = jnp.zeros((n,), jnp.int32)
    if num_speculative:
        spec = rows.draft_lens > 0
        verified, got = jax.lax.cond(
            jnp.any(spec),
            lambda h: verify_drafts(h, ops, n, num_speculative, lm_head, gather_logits, greedy_ids),
            lambda h: (tokens, accepted),
            hidden,
        )
        tokens = jnp.where(spec, verified, tokens)
        accepted = jnp.where(spec, got, 0)
    pad = max_rows - n
    mask = rows.sample_mask
    keep = jnp.where(mask, ops.req_slots[:n], last_tokens.shape[0])  # others dropped
    last_tokens = last_tokens.at[keep].set(tokens, mode="drop")
    tokens = jnp.pad(jnp.where(mask, tokens, -1), (0, pad), constant_values=-1)
    logprobs = jnp.pad(jnp.where(mask, logprobs, jnp.nan), (0, pad), constant_values=jnp.nan)
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
    top_ids, top_lp = jax.lax.cond(  # the [n, V] top-k only on steps that report it
        jnp.any(rows.top_logprobs > 0), top_logprobs,
        lambda _: (jnp.full((n, k), -1, jnp.int32), jnp.full((n, k), jnp.nan, jnp.float32)),
        logits,
    )  # fmt: skip
    top_ids = jnp.pad(jnp.where(mask[:, None], top_ids, -1), ((0, pad), (0, 0)), constant_values=-1)
    top_lp = jnp.pad(jnp.where(mask[:, None], top_lp, jnp.nan), ((0, pad), (0, 0)), constant_values=jnp.nan)
    targets = ops.prompt_targets
    # Full [T, V] logits only on steps that want prompt logprobs (lax.cond skips them else).
    plp = jax.lax.cond(
        jnp.any(targets >= 0),
        lambda h: prompt_logprobs(lm_head(h), targets),
        lambda h: jnp.full((t,), jnp.nan, jnp.float32),
        hidden,
    )
    accepted = jnp.pad(accepted, (0, pad))
    return penalties, last_tokens, tokens, logprobs, plp, (top_ids, top_lp), accepted
