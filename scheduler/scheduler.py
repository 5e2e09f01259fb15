"""`Scheduler`: planning steps and feeding their results back (DESIGN §4-6).

One step: `schedule()` plans every row (running requests first, in admission order, then waiting
ones via `scheduler.admission`; per request publish -> reclaim -> acquire), the device runs the
StepOps, and `update_step(ops, sampled)` appends tokens, finishes requests and publishes completed
pages. Retraction victim: the most recently admitted running request (LIFO). `schedule()` may run
one step ahead of `update` (overlapped scheduling); the rules that keep that exact are stated in
docs/architecture.md ("Runner and engine").

The pieces it composes, one concept each: `lifecycle` (request states and the pages and slots
each holds; the `Scheduler`'s base), `step_plan` (one step's rows), `drafting` (speculative
drafts per row), `step_update` (a row's results landing on its request), `stop` (the one stop
rule), `admission` (who fits the pool).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from scheduler.bucket_fit import fit_chunk
from scheduler.config import SchedulerConfig
from scheduler.coordinator import fits
from scheduler.drafting import check_proposal, plan_drafts
from scheduler.lifecycle import RequestLifecycle
from scheduler.mirror_check import MirrorChecker
from scheduler.ops_builder import ScheduledRow
from scheduler.request import Request, RequestOutput, Status
from scheduler.speculative import AcceptanceModel, SpeculativeConfig, StepCosts
from scheduler.step_ops import PLACEHOLDER_TOKEN, StepOps
from scheduler.step_plan import StepPlan
from scheduler.step_update import (
    StepResults,
    StepUpdate,
    accept_drafts,
    advance_computed,
    append_until_stop,
    checked_samples,
    roll_back_drafts,
)


class Scheduler(RequestLifecycle):
    """One replica's scheduler (see the module docstring); the request states and their moves
    are its base, `RequestLifecycle`."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        # False: every row takes the general path and `build` (tests compare the two)
        self.decode_fast_path = True
        self._spec = config.speculative
        # the runner's token buckets (ascending), set by the engine: speculation's draft
        # policy picks among them (() = unknown: every row drafts its whole proposal)
        self.token_buckets: tuple[int, ...] = ()
        # the "cost" draft policy's estimates (`speculative.choose_drafts`): how often a row's
        # proposals are right, learnt in `update`; step seconds per bucket, fed by the engine
        # (`note_step_seconds`), or set by hand (tests)
        cost_policy = self._spec is not None and self._spec.draft_policy == "cost"
        self.spec_model = AcceptanceModel() if cost_policy else None
        self.step_costs = StepCosts() if cost_policy else None
        # steps scheduled but not yet fed back: (ops, [(request, epoch) per row]), oldest first
        self._flights: collections.deque[tuple[StepOps, list[tuple[Request, int]]]] = collections.deque()
        self.mirror_checker = (
            MirrorChecker(self.layouts, config.num_live_slots) if config.debug_checks else None
        )

    def padding_ops(self) -> StepOps:
        """An all-padding StepOps of this config's shapes (device warm-up; changes nothing)."""
        return self._builder.build([])

    @property
    def num_in_flight(self) -> int:
        """Steps scheduled whose `update` has not come yet (0 in the synchronous loop)."""
        return len(self._flights)

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache (its K/V were computed with weights that changed, or live in
        a pool that was freed). Only between requests: RuntimeError while any is unfinished or a
        step is in flight. Returns how many page hashes were dropped."""
        if self.has_unfinished() or self._flights:
            raise RuntimeError("reset_prefix_cache needs an idle scheduler (requests or steps in flight)")
        host = 0 if self.host_tier is None else self.host_tier.drop_cached()
        return sum(pool.drop_cached() for pool in self.coord.pools) + host

    def prefix_match_tokens(self, prompt_token_ids: list[int], cache_salt: bytes = b"") -> int:
        """Prompt tokens a new request would take from the prefix cache right now (read-only;
        data-parallel routing sends a request to the replica with the longest match)."""
        return self._admission.prefix_match_tokens(prompt_token_ids, cache_salt)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepOps:
        """Plan the next step: release what the steps in flight end, rows for the running
        requests, admissions while rows, budget and slots last; emit the StepOps."""
        plan = StepPlan(budget=self.config.max_scheduled_tokens, ending=self._release_ending())
        if self._spec is not None:
            self._plan_drafts(plan)
        self._plan_running(plan)
        self._plan_waiting(plan)
        ops = self._emit(plan)
        if self.mirror_checker is not None:
            self.mirror_checker.apply(ops, self.authoritative_rows())
            self.check_invariants()
        return ops

    def _release_ending(self) -> set[Request]:
        """Overlapped: release the running requests whose token in flight certainly ends them
        (length) before anything allocates, as the synchronous loop's update would have, when
        every token the steps in flight compute for them is known (one step ahead). Returns the
        ones planned further ahead (`update` releases them): no row for them."""
        ending: set[Request] = set()
        if not self._flights:
            return ending
        max_len = self.config.max_context_len
        ends = [r for r in self._running if r.num_pending and r.finishes_by_length(max_len)]
        if ends:
            for r in ends:  # in running order: the freed slots' order is deterministic
                if r.num_computed + r.num_inflight <= len(r.tokens):
                    self._release_finishing(r)
                else:
                    ending.add(r)
            self._running = [r for r in self._running if r.status is Status.RUNNING]
        return ending

    def _plan_running(self, plan: StepPlan) -> None:
        """A row per running request, in admission order, while rows and budget last."""
        running, coord, adm = self._running, self.coord, self._admission
        max_rows, fast, ending = self.config.max_batch_requests, self.decode_fast_path, plan.ending
        room = adm.has_room()  # changes only on the general path
        i = 0
        while i < len(running) and len(plan.rows) < max_rows and plan.budget > 0:
            req = running[i]
            tokens = req.tokens
            pending = req.num_pending
            if ending and req in ending:
                i += 1
                continue
            start = req.num_computed + req.num_inflight
            # The extent everything before this row is known at: the scheduled one when the
            # tokens the step in flight computes are known (one step ahead), else the computed.
            extent = start if start <= len(tokens) else req.num_computed
            if extent // coord.base > req.published_base_pages:
                # pages the step in flight completes (their tokens are its inputs): publish them
                # now, as the synchronous loop's update would have before this schedule, so
                # prefix hits do not lag a step. Whoever hits them runs later.
                self._publish(req, extent)
                room = adm.has_room()  # adoption frees private copies
            drafts = plan.drafts.get(req) if plan.drafts else None
            if drafts:  # the step's budget may have run short of what `_plan_drafts` assumed
                drafts = drafts[: plan.budget - 1] or None
            # Decode fast path: one token, no refresh, room in every tail, nothing to reclaim
            # and no reservation shortfall. Exactly what the general path below would decide.
            if (
                fast
                and room
                and not drafts
                and req.num_decode_rows
                and not req.needs_refresh
                and not req.reserved
                and req.prefill_done
                and len(tokens) + pending - start == 1
                and coord.grow_in_tail(req.held_tables, extent)
            ):
                req.num_decode_rows += 1
                # the input is the last known token, or the one the step in flight samples
                plan.add_decode(req, req, start, PLACEHOLDER_TOKEN if pending else tokens[-1])
                i += 1
                continue
            budget = plan.budget
            if not drafts and req.remaining > 1:  # a prefill chunk
                budget = self._chunk_budget(plan, running, i)
            row = self._schedule_running(req, budget, extent, drafts)
            room = adm.has_room()
            if row is None:  # req itself was retracted (it was the LIFO victim)
                continue
            if fast and row.num_tokens == 1 and row.samples and not row.full_refresh:
                # a decode that took a page or punched a hole: still one column of the
                # decode builder, plus its group deltas
                plan.busy.append((len(plan.rows), row))
                plan.add_decode(
                    row, req, row.start, tokens[row.start] if row.start < len(tokens) else PLACEHOLDER_TOKEN
                )
            else:
                plan.add_general(row)
            i += 1

    def _chunk_budget(self, plan: StepPlan, running: list[Request], i: int) -> int:
        """The most tokens running[i]'s prefill chunk may take: the step's budget less one per
        decode row still to come after it (so a long chunk never starves them), then cut to
        the token buckets (`bucket_fit.fit_chunk`)."""
        ending = plan.ending
        after = sum(1 for r in running[i + 1 :] if r.remaining == 1 and r not in ending)
        after = min(after, self.config.max_batch_requests - len(plan.rows) - 1)
        budget = max(1, plan.budget - after)
        want = min(running[i].remaining, budget, self._admission.chunk_cap)
        used = self.config.max_scheduled_tokens - plan.budget
        return fit_chunk(used, want, after, self.token_buckets)

    def _admission_sizer(self, plan: StepPlan) -> Callable[[int], int]:
        """An admission's first chunk cut to the token buckets, after everything planned."""
        used, buckets = self.config.max_scheduled_tokens - plan.budget, self.token_buckets

        def size(n: int) -> int:
            return fit_chunk(used, n, 0, buckets)

        return size

    def _plan_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in queue order while rows, budget and slots last."""
        waiting, max_rows = self._waiting, self.config.max_batch_requests
        headroom: tuple[int, ...] | None = None  # computed at the first admission attempt
        # (O(running); a full batch with a waiting queue, the common decode case, never needs it)
        while waiting and len(plan.rows) < max_rows and plan.budget > 0 and self._free_slots:
            head = waiting[0]
            if head.num_pending:
                break  # retracted with a token in flight: it resumes once the token has landed
            if headroom is None:
                headroom = self._admission.pending_decode_growth(self._running)
            fit = self._admission.fit(head, plan.budget, headroom, self._admission_sizer(plan))
            if fit is None:
                break  # FCFS: the head waits for memory, nobody overtakes it
            row = self._admit(head, fit)
            waiting.pop(0)
            plan.add_general(row)

    def _emit(self, plan: StepPlan) -> StepOps:
        """The step's StepOps; a step with rows is in flight until its `update`."""
        ops, flight = plan.emit(self._builder)
        if self.host_tier is not None:
            copies = self.host_tier.emit(self.pool.has_key)
            if copies is not None:
                # copies come from rows' allocations and admissions: the engine dispatches
                # (and so applies) every step with rows
                assert plan.rows, "host-tier copies in a step without rows"
                ops = dataclasses.replace(ops, copies=copies)
        if plan.rows:
            self._flights.append((ops, flight))
        self._stats["num_steps"] += 1
        if plan.general:
            self._stats["num_full_refresh_rows"] += int(ops.full_refresh.sum())
        return ops

    def _plan_drafts(self, plan: StepPlan) -> None:
        """The step's drafts per speculating decode row (`drafting.plan_drafts`), chosen before
        any row is planned so the step's token bucket follows the proposals."""
        plan.drafts = plan_drafts(
            cast("SpeculativeConfig", self._spec),
            self._running,
            plan.ending,
            max_rows=self.config.max_batch_requests,
            max_context_len=self.config.max_context_len,
            chunk_cap=self._admission.chunk_cap,
            token_buckets=self.token_buckets,
            step_costs=self.step_costs,
            spec_model=self.spec_model,
        )

    def note_step_seconds(self, ops: StepOps, bucket: int, seconds: float) -> None:
        """The engine's wall time of one synchronous step (plan, device, update) that ran in
        token bucket `bucket`: a decode step (every row samples, one token plus its drafts)
        times its bucket for the "cost" draft policy (`speculative.StepCosts`); other steps are
        ignored (a prefill chunk's attention is not a decode's)."""
        costs = self.step_costs
        n = ops.num_seqs
        if costs is None or n == 0 or not ops.sample_mask[:n].all():
            return
        if int(ops.num_tokens) == n + int(ops.draft_lens[:n].sum()):
            costs.observe(bucket, seconds)

    def _schedule_running(
        self, req: Request, budget: int, extent: int, drafts: list[int] | None = None
    ) -> ScheduledRow | None:
        coord = self.coord
        n = min(req.remaining, budget, self._admission.chunk_cap)
        tables = req.held_tables  # running: set
        # Reclaim at `extent`, whose pages are already published (same hashes as the synchronous
        # loop). With a step in flight that is its scheduled extent: a slot that step still reads
        # may be freed now, as whoever gets the page is in a later step, which runs after it.
        holes = coord.reclaim(tables, extent)
        if drafts:
            # Speculation never retracts anyone: the drafts' pages must be free for the taking,
            # else the row decodes its one token as usual.
            k = 1 + len(drafts)
            if fits(coord.pages_needed(tables, k), self._admission.available_for(req)):
                row = self._admission.acquire_row(req, k, holes, samples=True)
                row.drafts = req.drafts = drafts
                return row
        need = coord.pages_needed(tables, n)
        while not fits(need, self._admission.available_for(req)):
            victim = self._running[-1]
            self._retract(victim)
            if victim is req:
                return None
        return self._admission.acquire_row(req, n, holes)

    # ------------------------------------------------------------------ update
    def update(
        self, ops: StepOps, sampled_token_ids: np.ndarray, accepted: np.ndarray | None = None
    ) -> list[RequestOutput]:
        """`update_step(ops, sampled_token_ids, accepted).finished`: the requests that finished."""
        return self.update_step(ops, sampled_token_ids, accepted).finished

    def update_step(
        self, ops: StepOps, sampled_token_ids: np.ndarray, accepted: np.ndarray | None = None
    ) -> StepUpdate:
        """Feed back one step: `sampled_token_ids` i32[max_batch_requests], entry i for row i;
        `accepted` i32[max_batch_requests]: drafts the device accepted per row (needed when a
        row has `draft_lens` > 0; row i then appends its first accepted[i] drafts and then
        sampled[i], and rolls its pages back to what it computed for those).

        Steps must be fed back in the order they were scheduled (at most the in-flight ones).
        Returns the requests that finished in this step and which rows were applied. Each row:
        accept drafts -> learn from its proposal -> advance the computed KV -> append tokens
        until the stop rule -> roll back rejected drafts -> publish -> retire if finished."""
        sampled = checked_samples(ops, sampled_token_ids)
        if ops.num_seqs == 0:
            return StepUpdate([], [])  # an empty step is never recorded (nothing ran)
        row_reqs = self._pop_flight(ops)
        step = StepResults(ops, sampled, accepted)
        update = StepUpdate([], [True] * ops.num_seqs)
        max_len, base, done_running = self.config.max_context_len, self.coord.base, False
        for i, (req, epoch) in enumerate(row_reqs):
            if req.status is Status.FINISHED:
                # finished by an earlier step's token or aborted: this row's token is dropped
                update.applied[i] = False
                self._stats["num_dropped_tokens"] += step.sample_mask[i]
                continue
            live = req.epoch == epoch  # else retracted meanwhile: the KV it wrote is void
            d = step.num_drafts[i]
            new = accept_drafts(req, step, i, self._stats)
            if req.proposal is not None:  # a speculating decode row proposed (`plan_drafts`)
                check_proposal(req, new, live, self.spec_model)
            if live:
                advance_computed(req, step, i, len(new))
            if new:
                append_until_stop(req, new, max_len)
                if d:
                    update.spec_tokens[i] = new
            if live:
                if d:
                    roll_back_drafts(req, self.coord)
                if req.num_computed // base > req.published_base_pages:  # a page completed
                    self._publish(req, req.num_computed)
            if req.finish_reason is not None:
                done_running |= req.status is Status.RUNNING
                update.finished.append(self._retire(req, live))
        if done_running:
            self._running = [r for r in self._running if r.status is Status.RUNNING]
        if self.mirror_checker is not None:
            self.check_invariants()
        return update

    def _pop_flight(self, ops: StepOps) -> list[tuple[Request, int]]:
        """The (request, epoch) rows of `ops`, which must be the oldest step in flight."""
        if not self._flights or self._flights[0][0] is not ops:
            raise ValueError(
                "update() must get the oldest scheduled, not yet updated StepOps "
                f"({len(self._flights)} in flight)"
            )
        return self._flights.popleft()[1]

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        pool = self.pool
        per_group = [0] * self._num_groups
        for req in self._running:
            for g, t in enumerate(req.held_tables):
                per_group[g] += sum(1 for p in t.pages if p)
        out: dict[str, Any] = dict(self._stats)
        out.update(
            free_pages=pool.num_free,
            total_pages=pool.num_pages - 1,
            used_pages=pool.num_used,
            reserved_pages=self._admission.reserved_total[0],
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_evictions=pool.num_evictions,
            group_pages={s.group_id: n for s, n in zip(self.config.group_specs, per_group)},
        )
        if len(self.coord.pools) > 1:  # the recurrent-state pool (`SchedulerConfig.state_pages`)
            state = self.coord.pools[1]
            out.update(
                state_free_pages=state.num_free,
                state_total_pages=state.num_pages - 1,
                state_used_pages=state.num_used,
                state_reserved_pages=self._admission.reserved_total[1],
                state_evictions=state.num_evictions,
            )
        if self.host_tier is not None:
            host = self.host_tier
            out.update(host.stats, host_pages=host.pool.num_pages, host_cached_pages=host.pool.num_cached)
            out["host_evictions"] = host.pool.num_evictions
        q = out["prefix_query_tokens"]
        out["prefix_hit_rate"] = out["prefix_hit_tokens"] / q if q else 0.0
        if self._spec is not None:
            drafted, rows = out["spec_draft_tokens"], out["spec_num_rows"]
            out["spec_acceptance_rate"] = out["spec_accepted_tokens"] / drafted if drafted else 0.0
            # tokens one speculative row yields: accepted drafts + the device's own token
            out["spec_mean_accepted_len"] = (out["spec_accepted_tokens"] + rows) / rows if rows else 0.0
        if self.mirror_checker is not None:
            out["tail_only_divergences"] = self.mirror_checker.tail_only_divergences
        return out
