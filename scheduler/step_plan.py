"""`StepPlan`: the rows of one step while the scheduler plans it, and their StepOps.

A plain decode (the scheduler's fast path) is recorded as its Request alone, any other row as a
`ScheduledRow`. Every one-token decode row also has its StepOps inputs (slot, start, input token)
in the plan's columns, so an all-decode step is emitted by the vectorised
`OpsBuilder.build_decode` with no `ScheduledRow` per plain row; any other step by
`OpsBuilder.build`.
"""

from __future__ import annotations

import dataclasses

from scheduler.ops_builder import OpsBuilder, ScheduledRow
from scheduler.request import Request
from scheduler.step_ops import StepOps


@dataclasses.dataclass(slots=True)
class StepPlan:
    """One step being planned (see the module docstring)."""

    budget: int  # tokens left this step
    ending: set[Request]  # their token in flight ends them: nothing to plan
    rows: list[ScheduledRow | Request] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)  # per one-token decode row
    starts: list[int] = dataclasses.field(default_factory=list)
    toks: list[int] = dataclasses.field(default_factory=list)
    busy: list[tuple[int, ScheduledRow]] = dataclasses.field(default_factory=list)  # with deltas
    general: bool = False  # some row is no one-token decode: `OpsBuilder.build` emits the step
    # speculative drafts per request, chosen before any row is planned (`_plan_drafts`)
    drafts: dict[Request, list[int]] = dataclasses.field(default_factory=dict)
    extras: bool = False  # some row needs the extra sampling fields

    def add_decode(self, row: ScheduledRow | Request, req: Request, start: int, tok: int) -> None:
        """A one-token decode row: `req` alone (plain) or its `ScheduledRow`; `tok` its input."""
        self.rows.append(row)
        self.slots.append(req.slot)
        self.starts.append(start)
        self.toks.append(tok)
        self.extras = self.extras or req.sampling.needs_extras
        self.budget -= 1

    def add_general(self, row: ScheduledRow) -> None:
        self.general = True
        self.rows.append(row)
        self.budget -= row.num_tokens

    def emit(self, builder: OpsBuilder) -> tuple[StepOps, list[tuple[Request, int]]]:
        """The step's StepOps and its (request, epoch) per row; advances the rows' counters
        (after the build: the builder reads the pre-step ones)."""
        if not self.general:  # every row a one-token decode (or none): numpy over the columns
            reqs = [row if isinstance(row, Request) else row.req for row in self.rows]
            ops = builder.build_decode(reqs, self.slots, self.starts, self.toks, self.extras, self.busy)
            for req in reqs:
                req.num_inflight += 1
                req.num_pending += 1
            return ops, [(req, req.epoch) for req in reqs]
        # counters are untouched until after build, so num_scheduled is still the start; a plain
        # row's per-group values are shared by the step's plain rows (never mutated)
        no_sizes = [0] * len(builder.layouts)
        no_holes: list[list[int]] = [[] for _ in builder.layouts]
        built = [
            ScheduledRow(
                req=row,
                start=row.num_scheduled,
                num_tokens=1,
                full_refresh=False,
                samples=True,
                begins=None,
                sizes=no_sizes,
                holes=no_holes,
                plain=True,
            )
            if isinstance(row, Request)
            else row
            for row in self.rows
        ]
        ops = builder.build(built)
        for row in built:
            req = row.req
            req.num_inflight += row.num_tokens
            if row.samples:
                req.num_pending += 1
        return ops, [(row.req, row.req.epoch) for row in built]
