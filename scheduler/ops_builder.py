"""Packs one step's scheduling decisions into a fixed-shape `StepOps` (numpy)."""

from __future__ import annotations

import dataclasses

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.request import Request
from scheduler.step_ops import GroupLayout, GroupStepOps, StepOps


@dataclasses.dataclass
class ScheduledRow:
    """One request's share of a step, as decided by the scheduler."""

    req: Request
    start: int  # tokens already in cache before this step
    num_tokens: int
    full_refresh: bool
    samples: bool
    begins: list[int]  # per group: first new slot (tail delta)
    sizes: list[int]  # per group: new slots appended this step
    holes: list[list[int]]  # per group: slots reclaimed into holes this step


class OpsBuilder:
    def __init__(self, config: SchedulerConfig) -> None:
        self.R = config.max_batch_requests
        self.T = config.max_scheduled_tokens
        self.layouts = tuple(
            GroupLayout(spec.group_id, spec.page_tokens, config.group_width(spec),
                        config.group_delta_width(spec))
            for spec in config.groups)

    def build(self, rows: list[ScheduledRow]) -> StepOps:
        R, T = self.R, self.T
        i32 = np.int32
        req_slots = np.full(R, -1, i32)
        full_refresh = np.zeros(R, bool)
        kv_lens = np.zeros(R, i32)
        sample_mask = np.zeros(R, bool)
        temperature = np.zeros(R, np.float32)
        top_p = np.ones(R, np.float32)
        top_k = np.full(R, -1, i32)
        seeds = np.zeros(R, np.uint32)
        sample_index = np.zeros(R, i32)
        token_ids = np.zeros(T, i32)
        positions = np.zeros(T, i32)
        token_rows = np.full(T, R, i32)
        prompt_targets = np.full(T, -1, i32)
        starts = [0] * (R + 1)
        groups = [self._empty_group(lay) for lay in self.layouts]
        q = 0
        for i, row in enumerate(rows):
            req, n, s = row.req, row.num_tokens, row.start
            starts[i] = q
            req_slots[i] = req.slot
            full_refresh[i] = row.full_refresh
            kv_lens[i] = s + n
            sample_mask[i] = row.samples
            temperature[i] = req.temperature
            top_p[i] = req.top_p
            top_k[i] = req.top_k
            seeds[i] = req.seed
            sample_index[i] = req.num_generated
            if n == 1:
                token_ids[q] = req.tokens[s]
                positions[q] = s
            else:
                token_ids[q:q + n] = req.tokens[s:s + n]
                positions[q:q + n] = np.arange(s, s + n, dtype=i32)
            token_rows[q:q + n] = i
            if req.prompt_logprobs and s < req.prompt_len - 1:
                stop = min(s + n, req.prompt_len - 1)
                prompt_targets[q:q + stop - s] = req.tokens[s + 1:stop + 1]
            q += n
            for g, arrays in enumerate(groups):
                begins, sizes, new_pages, full_rows, row_lens, hole_slots = arrays
                pages = req.tables[g].pages
                if row.full_refresh:
                    full_rows[i, :len(pages)] = pages
                    row_lens[i] = len(pages)
                else:
                    holes = row.holes[g]
                    if holes:
                        hole_slots[i, :len(holes)] = holes
                b, k = row.begins[g], row.sizes[g]
                begins[i] = b
                sizes[i] = k
                if k == 1:
                    new_pages[i, 0] = pages[b]
                elif k:
                    new_pages[i, :k] = pages[b:b + k]
        num_reqs = len(rows)
        starts[num_reqs:] = [q] * (R + 1 - num_reqs)
        return StepOps(
            num_reqs=num_reqs, num_tokens=q,
            request_ids=tuple(r.req.request_id for r in rows),
            req_slots=req_slots, full_refresh=full_refresh,
            query_start=np.asarray(starts, i32), kv_lens=kv_lens, sample_mask=sample_mask,
            token_ids=token_ids, positions=positions, token_rows=token_rows,
            prompt_targets=prompt_targets, temperature=temperature, top_p=top_p, top_k=top_k,
            seeds=seeds, sample_index=sample_index,
            groups=tuple(GroupStepOps(*arrays) for arrays in groups))

    def _empty_group(self, lay: GroupLayout) -> list[np.ndarray]:
        R = self.R
        return [np.zeros(R, np.int32), np.zeros(R, np.int32),
                np.zeros((R, lay.delta_width), np.int32), np.zeros((R, lay.width), np.int32),
                np.zeros(R, np.int32), np.full((R, lay.delta_width), lay.width, np.int32)]
