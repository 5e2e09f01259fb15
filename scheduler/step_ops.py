"""`StepOps`: the one typed host -> device record of a scheduler step.

Every array has a shape that depends only on the `SchedulerConfig` (never on the step), so the
jitted device step compiles once per shape bucket. Notation used in the field comments:

  R   = config.max_batch_requests   rows of a step (batch rows, not device slots)
  T   = config.max_scheduled_tokens query tokens of a step, packed row after row
  W_g = GroupLayout.width           max logical pages of one request in group g
  N_g = GroupLayout.delta_width     max tail-delta pages of one row in one step, group g

Device slots (`req_slots`) index the rows of the device page-table mirrors
(`i32[max_live_requests, W_g]` per group); batch row i of a step lives in slot `req_slots[i]`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Host-side id of an input token that only the device knows yet (sampled by the step in flight);
# `StepOps.token_from_prev` marks it and the device substitutes its slot's last sampled token.
PLACEHOLDER_TOKEN = -1


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Static shape facts of one cache group, derived from the config."""

    group_id: str
    block_size: int  # tokens per page of this group
    width: int  # W_g: columns of the page-table mirror = ceil(max_context_len / block_size)
    delta_width: int  # N_g: tail-delta columns per row and step


@dataclasses.dataclass(frozen=True)
class GroupStepOps:
    """Page-table mirror update of one cache group (DESIGN.md §6)."""

    begins: np.ndarray  # i32[R] first mirror column the tail delta writes; 0 padding
    sizes: np.ndarray  # i32[R] valid entries of new_pages; 0 padding (and on rows with no new page)
    new_pages: np.ndarray  # i32[R, N_g] tail-delta page ids, first sizes[i] valid; 0 (null) padding
    rows: np.ndarray  # i32[R, W_g] authoritative row, filled only where full_refresh; 0 padding
    row_lens: np.ndarray  # i32[R] valid entries of rows (0 unless full_refresh); 0 padding
    hole_slots: np.ndarray  # i32[R, N_g] columns reclaimed into holes on non-refresh rows; W_g padding


@dataclasses.dataclass(frozen=True)
class StepOps:
    """Everything the device needs for one step. Built by `Scheduler.schedule()`.

    Token layout: the query tokens of batch row i are `token_ids[query_start[i]:query_start[i+1]]`
    and sit at the last `query_start[i+1] - query_start[i]` positions of its `kv_lens[i]` tokens.
    """

    num_reqs: int  # rows in use this step (rows >= num_reqs are padding)
    num_tokens: int  # tokens in use this step (tokens >= num_tokens are padding)
    request_ids: tuple[str, ...]  # host only: request id of each used row, in row order
    req_slots: np.ndarray  # i32[R] device mirror slot of each row; -1 padding
    full_refresh: np.ndarray  # bool[R] rewrite the whole mirror row from column 0; False padding
    query_start: np.ndarray  # i32[R+1] cu_q_lens; padding rows repeat num_tokens
    kv_lens: np.ndarray  # i32[R] tokens in cache after this step (incl. this step's); 0 padding
    sample_mask: np.ndarray  # bool[R] the row's last token yields a sampled token; False padding
    token_ids: np.ndarray  # i32[T] input token ids; PLACEHOLDER_TOKEN where token_from_prev; 0 padding
    # bool[T] the token is the one the previous step sampled for this row's slot: the device
    # reads it from its per-slot copy (overlapped scheduling); False padding
    token_from_prev: np.ndarray
    positions: np.ndarray  # i32[T] absolute position of each token; 0 padding
    token_rows: np.ndarray  # i32[T] batch row of each token; R padding (out of range, dropped)
    prompt_targets: np.ndarray  # i32[T] next prompt token (prompt-logprob target); -1 none/padding
    temperature: np.ndarray  # f32[R] 0 = greedy; 0 padding
    top_p: np.ndarray  # f32[R] nucleus mass in (0, 1]; 1 padding
    top_k: np.ndarray  # i32[R] keep the k most likely tokens, -1 = all; -1 padding
    seeds: np.ndarray  # u32[R] per-request sampling seed; 0 padding
    sample_index: np.ndarray  # i32[R] tokens generated so far (PRNG fold-in); 0 padding
    groups: tuple[GroupStepOps, ...]  # one per cache group, in config.groups order

    def row_of(self, request_id: str) -> int:
        """Batch row of `request_id` in this step (ValueError if it is not scheduled)."""
        try:
            return self.request_ids.index(request_id)
        except ValueError:
            raise ValueError(f"request {request_id!r} is not in this step") from None

    def num_query_tokens(self, row: int) -> int:
        return int(self.query_start[row + 1] - self.query_start[row])
