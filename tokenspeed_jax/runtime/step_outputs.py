"""What one step gives back: device futures (`StepHandle`) and their host copies (`StepResult`)."""

from __future__ import annotations

import dataclasses
from typing import TypeAlias

import jax
import numpy as np

__all__ = ["StepHandle", "StepOutputs", "StepResult", "host_results"]

# device outputs of one step: sampled ids i32[R], logprobs f32[R], prompt logprobs f32[T],
# (top ids i32[R, K], top logprobs f32[R, K]), accepted drafts i32[R]
StepOutputs: TypeAlias = tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host copies of one step's outputs (R = max_batch_requests, T = max_scheduled_tokens).

    sampled i32[R]: token of each row whose `sample_mask` is set, -1 elsewhere.
    logprobs f32[R]: log-probability of that token (unmodified log-softmax); NaN where no token.
    prompt_logprobs f32[T]: logprob of `prompt_targets[t]` after token t; NaN where target -1.
    top_ids i32[R, K], top_logprobs f32[R, K] (K = sampling.MAX_TOP_LOGPROBS): each sampling
    row's K most likely tokens under the unmodified log-softmax, descending; None on steps where
    no row asked for them (`StepOps.top_logprobs`), -1 / NaN on rows that sample nothing.
    """

    sampled: np.ndarray
    logprobs: np.ndarray
    prompt_logprobs: np.ndarray
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    accepted: np.ndarray | None = None  # i32[R] drafts accepted per row; None: no drafts


@dataclasses.dataclass(frozen=True)
class StepHandle:
    """A dispatched step: device futures of its outputs (None for an empty step)."""

    tokens: jax.Array | None
    logprobs: jax.Array | None
    prompt_logprobs: jax.Array | None
    bucket: int
    top: tuple[jax.Array, jax.Array] | None = None  # (top ids, top logprobs) when asked for
    accepted: jax.Array | None = None  # drafts accepted per row, on steps with drafts

    def is_ready(self) -> bool:
        """True once the device has finished the step (never blocks)."""
        # ArrayImpl.is_ready exists at run time; jax.Array's type stubs do not declare it
        return self.tokens is None or self.tokens.is_ready()  # type: ignore[attr-defined]


def host_results(handle: StepHandle, rows: int, tokens: int) -> StepResult:
    """Block until a dispatched step is done; its host results at full size (R = `rows`,
    T = `tokens`; an empty step's are all padding)."""
    if handle.tokens is None:
        return StepResult(
            np.full(rows, -1, np.int32),
            np.full(rows, np.nan, np.float32),
            np.full(tokens, np.nan, np.float32),
        )
    plp_full = np.full(tokens, np.nan, np.float32)
    if handle.prompt_logprobs is not None:  # else all NaN: no copy
        plp_full[: handle.bucket] = np.asarray(handle.prompt_logprobs)
    top_ids = top_lp = None
    if handle.top is not None:
        top_ids, top_lp = np.asarray(handle.top[0]), np.asarray(handle.top[1])
    accepted = None if handle.accepted is None else np.asarray(handle.accepted)
    return StepResult(
        np.asarray(handle.tokens), np.asarray(handle.logprobs), plp_full, top_ids, top_lp, accepted
    )
