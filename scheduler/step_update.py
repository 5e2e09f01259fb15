"""Feeding one step's device results back into its requests: the row steps of
`Scheduler.update_step`.

Each row of a step that ran gives its request, in order: the drafts the device accepted and its
own sampled token (`accept_drafts`), the KV it computed (`advance_computed`), and those tokens
up to the first one that ends the request (`append_until_stop`, the one stop rule:
`stop.check_stop`). A speculative row that goes on then gives back the pages its rejected drafts
alone took (`roll_back_drafts`). What holds pool or queue state (publish, release) stays with the
`Scheduler`; everything here touches one request (and the coordinator, for the rollback).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from scheduler.coordinator import CacheCoordinator
from scheduler.request import Request, RequestOutput, Status
from scheduler.step_ops import StepOps
from scheduler.stop import check_stop


@dataclasses.dataclass(frozen=True)
class StepUpdate:
    """What `Scheduler.update_step` returns: the requests that finished in the step, and per row
    whether its result was applied (False for rows of requests that had finished or been aborted
    meanwhile; the engine routes logprobs by it)."""

    finished: list[RequestOutput]
    applied: list[bool]
    # row -> every token a speculative row appended (accepted drafts, then the device's own
    # token; cut after a stop / length), in order; rows without drafts append `sampled[row]`
    spec_tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)


def checked_samples(ops: StepOps, sampled_token_ids: np.ndarray) -> np.ndarray:
    """`sampled_token_ids` as an array, with an entry for every row of `ops` (else ValueError)."""
    sampled = np.asarray(sampled_token_ids)
    if sampled.shape[0] < ops.num_seqs:
        raise ValueError(f"{sampled.shape=} has fewer entries than the step's {ops.num_seqs} rows")
    return sampled


class StepResults:
    """One step's device results and row shapes as plain Python values, read once per step
    (numpy scalar access per row is slow)."""

    __slots__ = ("sample_mask", "cu_q_lens", "sampled", "num_drafts", "accepted")

    def __init__(self, ops: StepOps, sampled: np.ndarray, accepted: np.ndarray | None) -> None:
        """accepted: drafts the device accepted per row; needed when some row has drafts."""
        n = ops.num_seqs
        self.sample_mask: list[int] = ops.sample_mask[:n].tolist()
        self.cu_q_lens: list[int] = ops.cu_q_lens[: n + 1].tolist()
        self.sampled: list[int] = sampled[:n].tolist()
        self.num_drafts: list[int] = ops.draft_lens[:n].tolist()
        self.accepted: list[int] = []
        if any(self.num_drafts):
            if accepted is None:
                raise ValueError("a step with speculative drafts needs `accepted`")
            self.accepted = np.asarray(accepted)[:n].tolist()


def accept_drafts(req: Request, step: StepResults, i: int, stats: dict[str, int]) -> list[int]:
    """The tokens row `i` gives `req`, in order: its first accepted drafts (a speculative row),
    then the device's own token when the row samples (a prefill chunk's row may not). Counts the
    drafts in `stats`; ValueError when the device accepted more drafts than the row carried."""
    d = step.num_drafts[i]
    new = [int(step.sampled[i])] if step.sample_mask[i] else []
    if not d:
        return new
    a = int(step.accepted[i])
    if not 0 <= a <= d or len(req.drafts) != d:
        raise ValueError(f"row {i}: accepted {a} of {d} drafts ({len(req.drafts)} proposed)")
    new = req.drafts[:a] + new
    req.drafts = []
    stats["spec_num_rows"] += 1
    stats["spec_draft_tokens"] += d
    stats["spec_accepted_tokens"] += a
    return new


def advance_computed(req: Request, step: StepResults, i: int, num_new: int) -> None:
    """Row `i` has landed: its tokens leave `num_inflight` and have KV now. Of a speculative
    row's 1 + d positions only the first `num_new` (the input and the accepted drafts, before any
    stop cut) hold KV that stays; the rest are rolled back (`roll_back_drafts`)."""
    k = step.cu_q_lens[i + 1] - step.cu_q_lens[i]
    d = step.num_drafts[i]
    req.num_inflight -= k
    req.num_computed += k - d + num_new - 1 if d else k


def append_until_stop(req: Request, new: list[int], max_context_len: int) -> None:
    """Append the row's tokens `new` (its sampled token has landed: one placeholder fewer) up to
    the first that ends the request, which sets `finish_reason`; `new` is cut after it in place
    (nothing is kept past a stop or the length limit)."""
    req.num_pending -= 1
    tokens = req.tokens
    for j, tok in enumerate(new):
        tokens.append(tok)
        reason = check_stop(req, max_context_len, tok)
        if reason is not None:
            req.finish_reason = reason
            del new[j + 1 :]
            return


def roll_back_drafts(req: Request, coord: CacheCoordinator) -> None:
    """A live speculative row that goes on: give back the positions of its rejected drafts
    (tail room, and pages they alone took). The device row still lists dropped pages, so it
    refreshes whole next time. A finished or retracted request has released everything."""
    if (
        req.status is Status.RUNNING
        and req.finish_reason is None
        and coord.truncate(req.held_tables, req.num_computed)
    ):
        req.needs_refresh = True
