"""Packs one step's scheduling decisions into a fixed-shape `StepOps` (numpy)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, cast

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.request import Request
from scheduler.sampling_options import COLUMNS
from scheduler.step_ops import PLACEHOLDER_TOKEN, GroupLayout, GroupStepOps, StepOps, padding


@dataclasses.dataclass(slots=True)
class ScheduledRow:
    """One request's share of a step, as decided by the scheduler."""

    req: Request
    start: int  # tokens already in cache before this step
    num_tokens: int
    full_refresh: bool
    samples: bool
    begins: list[int] | None  # per group: first new slot (tail delta); None = row length now
    sizes: list[int]  # per group: new slots appended this step
    holes: list[list[int]]  # per group: slots reclaimed into holes this step
    # True only when the row has no full refresh, no new page and no hole in any group (a plain
    # decode): the builder then skips its per-group work. False is always safe.
    plain: bool = False
    # speculative drafts: the row's inputs are its last known token then these (verified on
    # the device, which samples at each of their positions)
    drafts: list[int] = dataclasses.field(default_factory=list)


class OpsBuilder:
    def __init__(self, config: SchedulerConfig) -> None:
        self.R = config.max_batch_requests
        self.T = config.max_scheduled_tokens
        self.layouts = config.group_layouts()
        # Sampling columns, from the SamplingOptions field metadata (`COLUMNS`), written per slot
        # by `bind` and gathered by both builders: "row" ones on every step, "extra" ones only in
        # steps where some row's record needs_extras (else they keep the padding, which is every
        # option's default, as they are for each row that needs no extras).
        assert all(len(c.columns) == 1 for c in COLUMNS if not c.extra), "pairs are extras"
        self._row_cols = [(operator.attrgetter(c.field), c.columns[0]) for c in COLUMNS if not c.extra]
        self._extra_cols = [
            (operator.attrgetter(c.field), c.columns[0]) for c in COLUMNS if c.extra and len(c.columns) == 1
        ]
        self._extra_pairs = [
            (operator.attrgetter(c.field), c.columns) for c in COLUMNS if c.extra and len(c.columns) == 2
        ]
        self._row_names = [col for _, col in self._row_cols]
        self._sampling_names = [name for c in COLUMNS for name in c.columns]
        # all-padding templates of every sampling column and prompt_lens (StepOps' padding)
        self._sampling_pad = {name: padding(name, self.R) for name in self._sampling_names}
        self._sampling_pad["prompt_lens"] = padding("prompt_lens", self.R)
        self._row_index = np.arange(self.R, dtype=np.int32)
        # padding-valued templates: copying one is cheaper than np.full / np.ones each step
        R, T, i32 = self.R, self.T, np.int32
        self._minus1_R = np.full(R, -1, i32)
        self._R_T = np.full(T, R, i32)
        self._minus1_T = np.full(T, -1, i32)
        self._hole_pad = [np.full((R, lay.delta_width), lay.width, i32) for lay in self.layouts]
        # all-decode fast path (`build_decode`): a decode step's cu_q_lens is min(i, n)
        self._qs_decode = [np.minimum(np.arange(R + 1, dtype=i32), k) for k in range(R + 1)]
        # per device slot: every sampling column of the request bound to it (`bind`), so a
        # decode step gathers them with one fancy index instead of one Python list per field
        S = config.num_live_slots
        self._slot_cols = {name: padding(name, S) for name in self._sampling_names}
        self._slot_prompt_len = np.zeros(S, i32)

    def bind(self, req: Request) -> None:
        """Record the (immutable) sampling fields of `req` under its new slot (at admission)."""
        s, sampling, slot_cols = req.slot, req.sampling, self._slot_cols
        for get, col in self._row_cols:
            slot_cols[col][s] = get(sampling)
        for get, col in self._extra_cols:
            slot_cols[col][s] = get(sampling)
        for get, names in self._extra_pairs:
            pairs = get(sampling)
            for j, name in enumerate(names):
                slot_cols[name][s] = self._sampling_pad[name][0]  # the slot's previous request
                slot_cols[name][s, : len(pairs)] = [p[j] for p in pairs]
        self._slot_prompt_len[s] = req.prompt_len

    def build(self, rows: list[ScheduledRow]) -> StepOps:
        """Column-wise: one list per field, one numpy assignment per field (O(batch + new
        pages) for a decode step; full rows only for refreshed requests)."""
        R, T = self.R, self.T
        i32 = np.int32
        n = len(rows)
        reqs = [r.req for r in rows]
        lens = [r.num_tokens for r in rows]
        starts = [r.start for r in rows]
        req_slots = self._minus1_R.copy()
        full_refresh = np.zeros(R, bool)
        kv_lens = np.zeros(R, i32)
        sample_mask = np.zeros(R, bool)
        draft_lens = np.zeros(R, i32)
        sample_index = np.zeros(R, i32)
        token_ids = np.zeros(T, i32)
        positions = np.zeros(T, i32)
        token_rows = self._R_T.copy()
        prompt_targets = self._minus1_T.copy()
        cu_q_lens = np.zeros(R + 1, i32)
        groups = [self._empty_group(g, lay) for g, lay in enumerate(self.layouts)]
        cols: dict[str, Any] = {k: v.copy() for k, v in self._sampling_pad.items()}
        q = sum(lens)
        if n:
            req_slots[:n] = [r.slot for r in reqs]
            full_refresh[:n] = [r.full_refresh for r in rows]
            kv_lens[:n] = [s + k for s, k in zip(starts, lens)]
            sample_mask[:n] = [r.samples for r in rows]
            samplings = [r.sampling for r in reqs]
            self._gather_sampling(cols, req_slots[:n], any(o.needs_extras for o in samplings))
            # tokens generated before the one this row samples (pending ones included)
            sample_index[:n] = [len(r.tokens) + r.num_pending - r.prompt_len for r in reqs]
            np.cumsum(lens, out=cu_q_lens[1 : n + 1])
            cu_q_lens[n + 1 :] = q
            if q == n:  # every row has one token (decodes)
                # a start past the known tokens is the pending token of the step in flight
                token_ids[:n] = [
                    r.tokens[s] if s < len(r.tokens) else PLACEHOLDER_TOKEN for r, s in zip(reqs, starts)
                ]
                positions[:n] = starts
                token_rows[:n] = self._row_index[:n]
            else:
                qs = cu_q_lens[:n]
                token_rows[:q] = np.repeat(self._row_index[:n], lens)
                positions[:q] = np.arange(q, dtype=i32) - np.repeat(qs - np.asarray(starts, i32), lens)
                off = 0
                for req, s, k in zip(reqs, starts, lens):
                    known = min(k, len(req.tokens) - s)
                    if known == 1:
                        token_ids[off] = req.tokens[s]
                    elif known > 0:
                        token_ids[off : off + known] = req.tokens[s : s + known]
                    off += k
                    if known < k:  # pending tokens (only the last one, at depth 1)
                        token_ids[off - k + max(known, 0) : off] = PLACEHOLDER_TOKEN
                for i, row in enumerate(rows):
                    if row.drafts:  # after the row's one known token (a synchronous decode)
                        end = int(cu_q_lens[i + 1])
                        token_ids[end - len(row.drafts) : end] = row.drafts
                        draft_lens[i] = len(row.drafts)
            off = 0
            wanted = [o.prompt_logprobs for o in samplings]
            for req, want, s, k in zip(reqs, wanted, starts, lens) if any(wanted) else ():
                if want and s < req.prompt_len - 1:
                    stop = min(s + k, req.prompt_len - 1)
                    prompt_targets[off : off + stop - s] = req.tokens[s + 1 : stop + 1]
                off += k
        busy = [(i, r) for i, r in enumerate(rows) if not r.plain]
        for g, arrays in enumerate(groups):
            if n:
                arrays[0][:n] = [
                    len(r.req.held_tables[g].pages) if r.begins is None else r.begins[g] for r in rows
                ]
            self._fill_busy(g, arrays, busy)
        return StepOps(
            num_seqs=n,
            num_tokens=q,
            request_ids=tuple(r.request_id for r in reqs),
            req_slots=req_slots,
            full_refresh=full_refresh,
            cu_q_lens=cu_q_lens,
            kv_lens=kv_lens,
            sample_mask=sample_mask,
            draft_lens=draft_lens,
            token_ids=token_ids,
            token_from_prev=token_ids == PLACEHOLDER_TOKEN,
            positions=positions,
            token_rows=token_rows,
            prompt_targets=prompt_targets,
            sample_index=sample_index,
            **cols,
            groups=tuple(GroupStepOps(*arrays) for arrays in groups),
        )

    def build_decode(
        self,
        reqs: list[Request],
        slots: list[int],
        starts: list[int],
        tokens: list[int],
        extras: bool,
        busy: list[tuple[int, ScheduledRow]],
    ) -> StepOps:
        """The StepOps `build` returns for rows that are all one-token decodes that sample
        without a full refresh, filled with numpy ops over the per-slot arrays. Row i: request
        reqs[i] in slots[i], start starts[i], input id tokens[i] (PLACEHOLDER_TOKEN when
        pending); busy: (i, its ScheduledRow) for the rows that are not plain (a new page or a
        hole in some group); extras: some request needs the penalty / logit_bias /
        top_logprobs fields. Must equal `build` exactly (tests/scheduler/
        test_decode_fast_path.py compares every array)."""
        R, T, i32 = self.R, self.T, np.int32
        n = len(reqs)
        slot_a = np.array(slots, i32)
        start_a = np.array(starts, i32)
        req_slots = self._minus1_R.copy()
        req_slots[:n] = slot_a
        kv_lens = np.zeros(R, i32)
        kv_lens[:n] = start_a + 1
        sample_mask = np.zeros(R, bool)
        sample_mask[:n] = True
        cols: dict[str, Any] = {k: v.copy() for k, v in self._sampling_pad.items()}
        self._gather_sampling(cols, slot_a, extras)
        prompt_lens = cols["prompt_lens"]
        # tokens generated before the sampled one: kv_len - 1 - prompt_len + 1
        sample_index = np.zeros(R, i32)
        sample_index[:n] = kv_lens[:n] - prompt_lens[:n]
        token_ids = np.zeros(T, i32)
        token_ids[:n] = tokens
        positions = np.zeros(T, i32)
        positions[:n] = start_a
        token_rows = self._R_T.copy()
        token_rows[:n] = self._row_index[:n]
        groups = []
        for g, lay in enumerate(self.layouts):
            arrays = self._empty_group(g, lay)
            begins = [len(r.held_tables[g].pages) for r in reqs]
            for i, row in busy:
                begins[i] = cast("list[int]", row.begins)[g]
            arrays[0][:n] = begins
            self._fill_busy(g, arrays, busy)
            groups.append(GroupStepOps(*arrays))
        return StepOps(
            num_seqs=n,
            num_tokens=n,
            request_ids=tuple(r.request_id for r in reqs),
            req_slots=req_slots,
            full_refresh=np.zeros(R, bool),
            cu_q_lens=self._qs_decode[n].copy(),
            kv_lens=kv_lens,
            sample_mask=sample_mask,
            draft_lens=np.zeros(R, i32),
            token_ids=token_ids,
            token_from_prev=token_ids == PLACEHOLDER_TOKEN,
            positions=positions,
            token_rows=token_rows,
            prompt_targets=self._minus1_T.copy(),
            sample_index=sample_index,
            **cols,
            groups=tuple(groups),
        )

    @staticmethod
    def _fill_busy(g: int, arrays: list[np.ndarray], busy: list[tuple[int, ScheduledRow]]) -> None:
        """Group g's mirror-update columns of the non-plain rows (batch index, row)."""
        _, sizes, new_pages, full_rows, row_lens, hole_slots = arrays
        for i, row in busy:
            pages = row.req.held_tables[g].pages  # running: set
            if row.full_refresh:
                full_rows[i, : len(pages)] = pages
                row_lens[i] = len(pages)
            else:
                holes = row.holes[g]
                if holes:
                    hole_slots[i, : len(holes)] = holes
            k = row.sizes[g]
            if k:
                b = cast("list[int]", row.begins)[g]  # set on every non-plain row
                sizes[i] = k
                if k == 1:
                    new_pages[i, 0] = pages[b]
                else:
                    new_pages[i, :k] = pages[b : b + k]

    def _gather_sampling(self, cols: dict[str, np.ndarray], slots: np.ndarray, extras: bool) -> None:
        """Rows 0..len(slots)-1 of the sampling columns and prompt_lens, gathered from the
        per-slot records `bind` wrote; the extra columns only when some row needs them (`extras`,
        else they stay padding, which is every option's default)."""
        n = len(slots)
        for name in self._sampling_names if extras else self._row_names:
            cols[name][:n] = self._slot_cols[name][slots]
        cols["prompt_lens"][:n] = self._slot_prompt_len[slots]

    def _empty_group(self, g: int, lay: GroupLayout) -> list[np.ndarray]:
        R = self.R
        return [
            np.zeros(R, np.int32),
            np.zeros(R, np.int32),
            np.zeros((R, lay.delta_width), np.int32),
            np.zeros((R, lay.width), np.int32),
            np.zeros(R, np.int32),
            self._hole_pad[g].copy(),
        ]
