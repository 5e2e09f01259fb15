"""`StepOps`: the one typed host -> device record of a scheduler step.

Every array has a shape that depends only on the `SchedulerConfig` (never on the step), so the
jitted device step compiles once per shape bucket. Notation used in the field comments:

  R   = config.max_batch_requests   rows of a step (batch rows, not device slots)
  T   = config.max_scheduled_tokens query tokens of a step, packed row after row
  W_g = GroupLayout.width           max logical pages of one request in group g
  N_g = GroupLayout.delta_width     max tail-delta pages of one row in one step, group g
  B   = LOGIT_BIAS_WIDTH (64)         logit_bias entries of one row (a request may carry at most B)

Device slots (`req_slots`) index the rows of the device page-table mirrors
(`i32[max_live_requests, W_g]` per group); batch row i of a step lives in slot `req_slots[i]`.

Schema: every field that goes to the device carries `metadata={"axis": ..., "dtype": ...}`
(`device_schema()` lists them), so the runner moves a StepOps to the device generically (packed
into one int32 and one float32 buffer) and a new field needs no runner edit. Axes:
  "row" [R], "row+1" [R+1], "token" [T] (the runner cuts it to the step's token bucket),
  "row,delta" [R, N_g], "row,width" [R, W_g] (the runner cuts it to the step's kv bucket: only
  columns below the longest row of the step can hold a page), "row,bias" [R, B].
dtypes: "i32", "bool" and "u32" travel in the int32 buffer (bit-exact), "f32" in the float32 one.
Per-request sampling fields also carry their constant padding value ("pad"): the builder fills
them from `SamplingOptions` field metadata (scheduler/sampling_options.py `COLUMNS`).
Fields without an axis (num_seqs, num_tokens, request_ids) stay on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from scheduler.host_tier import PageCopies

AXES = ("row", "row+1", "token", "row,delta", "row,width", "row,bias")
LOGIT_BIAS_WIDTH = 64  # B: logit_bias entries per row (fixed, so it is no shape-key dimension)
DTYPES = ("i32", "bool", "u32", "f32")


def _dev(axis: str, dtype: str = "i32", pad: float | None = None) -> Any:
    """A device field of `axis` (see module docstring) and wire dtype; `pad`: its constant padding
    value, where the builders fill it from one (`padding`)."""
    assert axis in AXES and dtype in DTYPES, (axis, dtype)
    meta: dict[str, Any] = {"axis": axis, "dtype": dtype}
    if pad is not None:
        meta["pad"] = pad
    return dataclasses.field(metadata=meta)


# Host-side id of an input token that only the device knows yet (sampled by the step in flight);
# `StepOps.token_from_prev` marks it and the device substitutes its slot's last sampled token.
PLACEHOLDER_TOKEN = -1


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Static shape facts of one cache group, derived from the config."""

    group_id: str
    page_size: int  # tokens per page of this group
    width: int  # W_g: columns of the page-table mirror = ceil(max_context_len / page_size)
    delta_width: int  # N_g: tail-delta columns per row and step


@dataclasses.dataclass(frozen=True)
class GroupStepOps:
    """Page-table mirror update of one cache group (DESIGN.md §6)."""

    begins: np.ndarray = _dev("row", "i32")  # i32[R] first mirror column the tail delta writes; 0 padding
    # i32[R] valid entries of new_pages; 0 padding (and on rows with no new page)
    sizes: np.ndarray = _dev("row", "i32")
    # i32[R, N_g] tail-delta page ids, first sizes[i] valid; 0 (null) padding
    new_pages: np.ndarray = _dev("row,delta", "i32")
    # i32[R, W_g] authoritative row, filled only where full_refresh; 0 padding
    rows: np.ndarray = _dev("row,width", "i32")
    # i32[R] valid entries of rows (0 unless full_refresh); 0 padding
    row_lens: np.ndarray = _dev("row", "i32")
    # i32[R, N_g] columns reclaimed into holes on non-refresh rows; W_g padding
    hole_slots: np.ndarray = _dev("row,delta", "i32")


@dataclasses.dataclass(frozen=True)
class StepOps:
    """Everything the device needs for one step. Built by `Scheduler.schedule()`.

    Token layout: the query tokens of batch row i are `token_ids[cu_q_lens[i]:cu_q_lens[i+1]]`
    and sit at the last `cu_q_lens[i+1] - cu_q_lens[i]` positions of its `kv_lens[i]` tokens
    (the kernels' `cu_q_lens` / `num_seqs` contract, SPEC.md).
    """

    num_seqs: int  # rows in use this step (rows >= num_seqs are padding); SPEC: `num_reqs`
    num_tokens: int  # tokens in use this step (tokens >= num_tokens are padding)
    request_ids: tuple[str, ...]  # host only: request id of each used row, in row order
    req_slots: np.ndarray = _dev("row", "i32")  # i32[R] device mirror slot of each row; -1 padding
    # bool[R] rewrite the whole mirror row from column 0; False padding
    full_refresh: np.ndarray = _dev("row", "bool")
    cu_q_lens: np.ndarray = _dev("row+1", "i32")  # i32[R+1]; padding rows repeat num_tokens
    # i32[R] tokens in cache after this step (incl. this step's); 0 padding
    kv_lens: np.ndarray = _dev("row", "i32")
    # bool[R] the row's last token yields a sampled token; False padding
    sample_mask: np.ndarray = _dev("row", "bool")
    # i32[R] speculative drafts among the row's last query tokens: the device verifies them
    # and samples at each of the row's last draft_lens + 1 positions; 0 padding (no drafts)
    draft_lens: np.ndarray = _dev("row", "i32", 0)
    # i32[T] input token ids; PLACEHOLDER_TOKEN where token_from_prev; 0 padding
    token_ids: np.ndarray = _dev("token", "i32")
    # bool[T] the token is the one the previous step sampled for this row's slot: the device
    # reads it from its per-slot copy (overlapped scheduling); False padding
    token_from_prev: np.ndarray = _dev("token", "bool")
    positions: np.ndarray = _dev("token", "i32")  # i32[T] absolute position of each token; 0 padding
    # i32[T] batch row of each token; R padding (out of range, dropped)
    token_rows: np.ndarray = _dev("token", "i32")
    # i32[T] next prompt token (prompt-logprob target); -1 none/padding
    prompt_targets: np.ndarray = _dev("token", "i32")
    temperature: np.ndarray = _dev("row", "f32", 0.0)  # f32[R] 0 = greedy; 0 padding
    top_p: np.ndarray = _dev("row", "f32", 1.0)  # f32[R] nucleus mass in (0, 1]; 1 padding
    top_k: np.ndarray = _dev("row", "i32", -1)  # i32[R] keep the k most likely tokens, -1 = all; -1 padding
    seeds: np.ndarray = _dev("row", "u32", 0)  # u32[R] per-request sampling seed; 0 padding
    sample_index: np.ndarray = _dev("row", "i32")  # i32[R] tokens generated so far (PRNG fold-in); 0 padding
    # i32[R] prompt length (inputs at positions >= it count as output); 0 padding
    prompt_lens: np.ndarray = _dev("row", "i32", 0)
    # f32[R] subtracted once from the logit of every token already generated; 0 padding
    presence_penalty: np.ndarray = _dev("row", "f32", 0.0)
    # f32[R] subtracted per occurrence of the token in the output; 0 padding
    frequency_penalty: np.ndarray = _dev("row", "f32", 0.0)
    # f32[R] divides (> 0) / multiplies (< 0) logits of tokens seen in prompt or output; 1 padding
    repetition_penalty: np.ndarray = _dev("row", "f32", 1.0)
    # i32[R, B] token ids whose logits get a bias; -1 padding (the device drops them)
    logit_bias_ids: np.ndarray = _dev("row,bias", "i32", -1)
    # f32[R, B] bias added to those logits; 0 padding
    logit_bias_values: np.ndarray = _dev("row,bias", "f32", 0.0)
    # i32[R] most likely tokens to report with logprobs (<= 20); 0 padding
    top_logprobs: np.ndarray = _dev("row", "i32", 0)
    # mypy takes the `_dev(...)` fields above for defaults; they have none (dataclasses.field)
    groups: tuple[GroupStepOps, ...]  # type: ignore[misc]  # one per cache group, in config.groups order
    # host only: the host KV tier's page copies, applied before this step writes (None: none;
    # `scheduler.host_tier.PageCopies`, fixed-shape columns padded with the drop sentinels)
    copies: PageCopies | None = None

    @property
    def num_reqs(self) -> int:
        """SPEC.md's name of `num_seqs`."""
        return self.num_seqs

    def row_of(self, request_id: str) -> int:
        """Batch row of `request_id` in this step (ValueError if it is not scheduled)."""
        try:
            return self.request_ids.index(request_id)
        except ValueError:
            raise ValueError(f"request {request_id!r} is not in this step") from None

    def num_query_tokens(self, row: int) -> int:
        return int(self.cu_q_lens[row + 1] - self.cu_q_lens[row])


def device_schema(cls: type) -> tuple[tuple[str, str, str], ...]:
    """(name, axis, dtype) of every device field of `StepOps` or `GroupStepOps`, in field order."""
    return tuple(
        (f.name, f.metadata["axis"], f.metadata["dtype"])
        for f in dataclasses.fields(cls)
        if "axis" in f.metadata
    )


_NP_DTYPES = {"i32": np.int32, "bool": np.bool_, "u32": np.uint32, "f32": np.float32}
# the sampling columns a StepOps built by hand (tests) names itself; `sampling_padding` the rest
CORE_SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "seeds")


def padding(name: str, num_rows: int) -> np.ndarray:
    """An all-padding array of the StepOps field `name` (one with a `pad`; axis "row" or
    "row,bias") for `num_rows` rows."""
    meta = {f.name: f.metadata for f in dataclasses.fields(StepOps)}[name]
    shape = {"row": (num_rows,), "row,bias": (num_rows, LOGIT_BIAS_WIDTH)}[meta["axis"]]
    return np.full(shape, meta["pad"], _NP_DTYPES[meta["dtype"]])


def sampling_padding(num_rows: int) -> dict[str, np.ndarray]:
    """All-padding arrays of the padded per-request fields beyond `CORE_SAMPLING_COLUMNS`
    (prompt_lens, the penalty / logit_bias / top_logprobs fields and any later option's), so a
    StepOps built by hand stays complete when an option is added."""
    return {
        f.name: padding(f.name, num_rows)
        for f in dataclasses.fields(StepOps)
        if "pad" in f.metadata and f.name not in CORE_SAMPLING_COLUMNS
    }
