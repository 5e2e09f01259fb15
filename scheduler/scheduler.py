"""`Scheduler`: request lifecycle, chunked prefill, prefix cache, retraction, StepOps (DESIGN §4-6).

One step: `schedule()` plans every row (running requests first, in admission order, then waiting
ones via `scheduler.admission`; per request publish -> reclaim -> acquire), the device runs the
StepOps, and `update_step(ops, sampled)` appends tokens, finishes requests and publishes completed
pages. Retraction victim: the most recently admitted running request (LIFO). `schedule()` may run
one step ahead of `update` (overlapped scheduling); the rules that keep that exact are stated in
docs/architecture.md ("Runner and engine").
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from scheduler.admission import Admission, Admitted, check_prompt, requeue
from scheduler.block_pool import BlockPool
from scheduler.block_table import BlockTable
from scheduler.bucket_fit import fit_chunk
from scheduler.config import SchedulerConfig
from scheduler.coordinator import CacheCoordinator
from scheduler.group_spec import PagedCacheGroupSpec
from scheduler.mirror_check import MirrorChecker
from scheduler.ops_builder import OpsBuilder, ScheduledRow
from scheduler.request import Request, RequestOutput, Status
from scheduler.sampling_options import SamplingOptions
from scheduler.speculative import AcceptanceModel, StepCosts, choose_drafts, propose_ngram
from scheduler.step_ops import PLACEHOLDER_TOKEN, StepOps
from scheduler.step_plan import StepPlan


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


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_pages)
        self.coord = CacheCoordinator(cast("list[PagedCacheGroupSpec]", config.groups), self.pool)
        self._builder = OpsBuilder(config)
        self.layouts = self._builder.layouts
        self._requests: dict[str, Request] = {}
        self._waiting: list[Request] = []  # retracted requests first, then arrival order
        self._running: list[Request] = []  # admission order
        self._free_slots = list(range(config.num_live_slots - 1, -1, -1))
        self._arrival = itertools.count()
        self._num_finishing = 0  # Status.FINISHING: released, last token still in flight
        self._admission = Admission(config, self.coord, self.layouts)  # pages and reservations
        self._num_groups = len(cast("list[PagedCacheGroupSpec]", config.groups))
        # False: every row takes the general path and `build` (tests compare the two)
        self.decode_fast_path = True
        self._stats = {"num_retractions": 0, "prefix_hit_tokens": 0, "prefix_query_tokens": 0,
                       "adopted_pages": 0, "num_steps": 0, "num_aborted": 0,
                       "num_full_refresh_rows": 0, "num_dropped_tokens": 0,
                       "spec_num_rows": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
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
        self._flights: collections.deque[tuple[StepOps, list[tuple[Request, int]]]] = (
            collections.deque())
        self.mirror_checker = (MirrorChecker(self.layouts, config.num_live_slots)
                               if config.debug_checks else None)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], max_new_tokens: int, *,
                    sampling: SamplingOptions | None = None, speculate: bool = True,
                    **options: Any) -> None:
        """Queue a request sampled as `sampling` says. Without it, the keyword options build the
        record (`SamplingOptions.from_options`: its field names, e.g. stop_token_ids,
        temperature, top_p, top_k, seed, prompt_logprobs, penalties, logit_bias, top_logprobs).
        cache_salt (str | bytes) is the one other option. speculate=False keeps the request out
        of speculative decoding (requests with penalties, logit_bias, top logprobs or prompt
        logprobs never speculate). Raises ValueError on bad input, naming unknown options
        (nothing changes then)."""
        cfg = self.config
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        try:
            prompt = self.check_prompt(prompt_token_ids, max_new_tokens)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        need = self.coord.solo_peak_pages(len(prompt) + max_new_tokens, cfg.max_scheduled_tokens)
        if need > self.pool.num_pages - 1:
            raise ValueError(f"request {request_id!r}: needs {need} cache pages even alone, the "
                             f"pool has {self.pool.num_pages - 1}")
        salt = options.pop("cache_salt", None)
        try:
            if sampling is None:
                sampling = SamplingOptions.from_options(options)
            elif not isinstance(sampling, SamplingOptions):
                raise ValueError(f"sampling must be a SamplingOptions, got {type(sampling).__name__}")
            elif options:
                raise ValueError(f"options {sorted(options)} beside sampling= (put them in it)")
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        speculate = (speculate and self._spec is not None and not sampling.needs_extras
                     and not sampling.prompt_logprobs)
        req = Request(request_id, prompt, max_new_tokens, sampling=sampling, cache_salt=salt,
                      arrival=next(self._arrival), hash_base=self.coord.base, speculate=speculate)
        self._requests[request_id] = req
        self._waiting.append(req)

    def check_prompt(self, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
        """`admission.check_prompt` under this config's max_context_len (the engine validates
        with it)."""
        return check_prompt(prompt_token_ids, max_new_tokens, self.config.max_context_len)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; its pages come back at once. Unknown ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if req.status is Status.RUNNING:
            self._release(req)
            self._running.remove(req)
        elif req.status is Status.FINISHING:  # holds nothing; its in-flight token is dropped
            self._num_finishing -= 1
        elif req in self._waiting:
            self._waiting.remove(req)
            req.epoch += 1
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        self._stats["num_aborted"] += 1

    def padding_ops(self) -> StepOps:
        """An all-padding StepOps of this config's shapes (device warm-up; changes nothing)."""
        return self._builder.build([])

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._num_finishing)

    @property
    def num_in_flight(self) -> int:
        """Steps scheduled whose `update` has not come yet (0 in the synchronous loop)."""
        return len(self._flights)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_unfinished(self) -> int:
        """Running + waiting requests (a replica's load, for routing)."""
        return len(self._running) + len(self._waiting)

    @property
    def num_waiting(self) -> int:
        """Requests queued and not running (one read of a list's length: safe from another
        thread while this one plans a step)."""
        return len(self._waiting)

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
        running, pool, coord, adm = self._running, self.pool, self.coord, self._admission
        max_rows, fast, ending = self.config.max_batch_requests, self.decode_fast_path, plan.ending
        room = pool.num_free >= adm.reserved_total  # changes only on the general path
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
                room = pool.num_free >= adm.reserved_total  # adoption frees private copies
            drafts = plan.drafts.get(req) if plan.drafts else None
            if drafts:  # the step's budget may have run short of what `_plan_drafts` assumed
                drafts = drafts[:plan.budget - 1] or None
            # Decode fast path: one token, no refresh, room in every tail, nothing to reclaim
            # and no reservation shortfall. Exactly what the general path below would decide.
            if (fast and room and not drafts and req.num_decode_rows and not req.needs_refresh
                    and not req.reserved and req.prefill_done
                    and len(tokens) + pending - start == 1
                    and coord.grow_in_tail(cast("list[BlockTable]", req.tables), extent)):
                req.num_decode_rows += 1
                # the input is the last known token, or the one the step in flight samples
                plan.add_decode(req, req, start, PLACEHOLDER_TOKEN if pending else tokens[-1])
                i += 1
                continue
            budget = plan.budget
            if not drafts and req.remaining > 1:  # a prefill chunk
                budget = self._chunk_budget(plan, running, i)
            row = self._schedule_running(req, budget, extent, drafts)
            room = pool.num_free >= adm.reserved_total
            if row is None:  # req itself was retracted (it was the LIFO victim)
                continue
            if fast and row.num_tokens == 1 and row.samples and not row.full_refresh:
                # a decode that took a page or punched a hole: still one column of the
                # decode builder, plus its group deltas
                plan.busy.append((len(plan.rows), row))
                plan.add_decode(row, req, row.start,
                                tokens[row.start] if row.start < len(tokens) else PLACEHOLDER_TOKEN)
            else:
                plan.add_general(row)
            i += 1

    def _chunk_budget(self, plan: StepPlan, running: list[Request], i: int) -> int:
        """The most tokens running[i]'s prefill chunk may take: the step's budget less one per
        decode row still to come after it (so a long chunk never starves them), then cut to
        the token buckets (`bucket_fit.fit_chunk`)."""
        ending = plan.ending
        after = sum(1 for r in running[i + 1:] if r.remaining == 1 and r not in ending)
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
        headroom = -1  # computed at the first admission attempt (O(running); a full batch
        # with a waiting queue, the common decode case, never needs it)
        while waiting and len(plan.rows) < max_rows and plan.budget > 0 and self._free_slots:
            head = waiting[0]
            if head.num_pending:
                break  # retracted with a token in flight: it resumes once the token has landed
            if headroom < 0:
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
        if plan.rows:
            self._flights.append((ops, flight))
        self._stats["num_steps"] += 1
        if plan.general:
            self._stats["num_full_refresh_rows"] += int(ops.full_refresh.sum())
        return ops

    def _plan_drafts(self, plan: StepPlan) -> None:
        """Every speculating decode row's proposal, then how many of its drafts the step carries
        (`speculative.choose_drafts`): known before any row is planned, so the step's token
        bucket follows the proposals (no proposal: no drafts, the smallest bucket). A row may
        propose when its tokens are all known (synchronous loop) and its prefill is done; its
        proposal is capped by max_tokens, max_context_len and the chunk cap after its own
        token, and kept whole in `Request.proposal` for `update` to check (the acceptance model
        learns from rows that drafted nothing too)."""
        spec = self._spec
        assert spec is not None
        k, ctx, cap = (spec.num_speculative_tokens, self.config.max_context_len,
                       self._admission.chunk_cap)
        max_rows, ending = self.config.max_batch_requests, plan.ending
        reqs: list[Request] = []
        proposals: list[tuple[int, int]] = []
        num_rows = 0
        for req in self._running:
            if num_rows == max_rows:
                break
            req.proposal = None
            if ending and req in ending:
                continue
            num_rows += 1
            tokens = req.tokens
            if not (req.speculate and not req.num_pending and not req.num_inflight
                    and req.prefill_done and len(tokens) - req.num_computed == 1):
                continue
            n = min(k, req.max_new_tokens - req.num_generated - 1, ctx - len(tokens) - 1,
                    cap - 1)
            proposal = (propose_ngram(tokens, n, spec.prompt_lookup_min, spec.prompt_lookup_max)
                        if n >= 1 else [])
            req.proposal = proposal
            if proposal:
                reqs.append(req)
                proposals.append((len(proposal), req.spec_run))
        if not reqs:
            return
        counts = choose_drafts(spec, proposals, num_rows, self.token_buckets, max_rows,
                               self.step_costs, self.spec_model)
        plan.drafts = {req: cast("list[int]", req.proposal)[:d]
                       for req, d in zip(reqs, counts) if d}

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

    def _schedule_running(self, req: Request, budget: int, extent: int,
                          drafts: list[int] | None = None) -> ScheduledRow | None:
        coord = self.coord
        n = min(req.remaining, budget, self._admission.chunk_cap)
        tables = cast("list[BlockTable]", req.tables)  # running: set
        # Reclaim at `extent`, whose pages are already published (same hashes as the synchronous
        # loop). With a step in flight that is its scheduled extent: a slot that step still reads
        # may be freed now, as whoever gets the page is in a later step, which runs after it.
        holes = coord.reclaim(tables, extent)
        if drafts:
            # Speculation never retracts anyone: the drafts' pages must be free for the taking,
            # else the row decodes its one token as usual.
            k = 1 + len(drafts)
            if coord.blocks_needed_for(tables, k) <= self._admission.available_for(req):
                row = self._admission.acquire_row(req, k, holes, samples=True)
                row.drafts = req.drafts = drafts
                return row
        need = coord.blocks_needed_for(tables, n)
        while need > self._admission.available_for(req):
            victim = self._running[-1]
            self._retract(victim)
            if victim is req:
                return None
        return self._admission.acquire_row(req, n, holes)

    def _admit(self, req: Request, fit: Admitted) -> ScheduledRow:
        """Start a waiting request that fits: a slot, then its first chunk's row."""
        if not req.admitted_once:
            self._stats["prefix_hit_tokens"] += fit.hit
            self._stats["prefix_query_tokens"] += req.prompt_len
        req.slot = self._free_slots.pop()
        self._builder.bind(req)
        req.status = Status.RUNNING
        self._running.append(req)
        return self._admission.admit(req, fit)

    # ------------------------------------------------------------------ retraction / release
    def _retract(self, req: Request) -> None:
        self._release(req)
        self._running.remove(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_retractions += 1
        self._stats["num_retractions"] += 1
        requeue(self._waiting, req)

    def _release_finishing(self, req: Request) -> None:
        """Overlapped loop: `req`'s token in flight certainly ends it (length). Publish the pages
        that step completes (their tokens are all known: the step's inputs), then free its pages
        and slot. Exact: the step in flight still writes them, and whoever gets them next is
        scheduled into a later step, which the device runs after it. `update` finishes it."""
        self._publish(req, req.num_computed + req.num_inflight)
        self._release(req)
        req.status = Status.FINISHING
        self._num_finishing += 1

    def _publish(self, req: Request, computed: int) -> None:
        """Publish the request's full base pages up to `computed` tokens (prefix cache)."""
        coord = self.coord
        if computed // coord.base <= req.published_base_pages:
            return
        req.hasher.extend(req.tokens)
        moved = coord.publish(cast("list[BlockTable]", req.tables), req.hasher.hashes, computed,
                              adopt=self.config.enable_adoption, chunk_end=True)
        req.published_base_pages = computed // coord.base
        if any(moved):
            req.needs_refresh = True
            self._stats["adopted_pages"] += sum(len(m) for m in moved)

    def _check_proposal(self, req: Request, proposal: list[int], new: list[int]) -> None:
        """The tokens a decode row appended against the proposal its request made for them
        (drafted or not): the run of tokens proposals predicted (`Request.spec_run`) grows by
        the matches, or restarts at 0 on a miss; the acceptance model learns both."""
        seen = min(len(new), len(proposal))
        m = 0
        while m < seen and new[m] == proposal[m]:
            m += 1
        missed = m < seen or not proposal  # no proposal: nothing predicted the token
        if self.spec_model is not None and proposal:
            self.spec_model.observe(req.spec_run, m, missed)
        req.spec_run = 0 if missed else req.spec_run + m

    def _release(self, req: Request) -> None:
        self.coord.free(cast("list[BlockTable]", req.tables))
        req.proposal = None
        req.tables = None
        self._free_slots.append(req.slot)
        req.slot = -1
        self._admission.settle(req)
        req.needs_refresh = True
        req.prefill_done = False
        req.num_decode_rows = 0
        req.num_inflight = 0  # whatever a step in flight computes for it is void now
        req.epoch += 1

    # ------------------------------------------------------------------ update
    def update(self, ops: StepOps, sampled_token_ids: np.ndarray,
               accepted: np.ndarray | None = None) -> list[RequestOutput]:
        """`update_step(ops, sampled_token_ids, accepted).finished`: the requests that finished."""
        return self.update_step(ops, sampled_token_ids, accepted).finished

    def update_step(self, ops: StepOps, sampled_token_ids: np.ndarray,
                    accepted: np.ndarray | None = None) -> StepUpdate:
        """Feed back one step: `sampled_token_ids` i32[max_batch_requests], entry i for row i;
        `accepted` i32[max_batch_requests]: drafts the device accepted per row (needed when a
        row has `draft_lens` > 0; row i then appends its first accepted[i] drafts and then
        sampled[i], and rolls its pages back to what it computed for those).

        Steps must be fed back in the order they were scheduled (at most the in-flight ones).
        Returns the requests that finished in this step and which rows were applied."""
        sampled = np.asarray(sampled_token_ids)
        if sampled.shape[0] < ops.num_seqs:
            raise ValueError(f"{sampled.shape=} has fewer entries than the step's {ops.num_seqs} rows")
        if ops.num_seqs == 0:
            return StepUpdate([], [])  # an empty step is never recorded (nothing ran)
        if not self._flights or self._flights[0][0] is not ops:
            raise ValueError("update() must get the oldest scheduled, not yet updated StepOps "
                             f"({len(self._flights)} in flight)")
        _, row_reqs = self._flights.popleft()
        finished: list[RequestOutput] = []
        base = self.coord.base
        max_len = self.config.max_context_len
        n = ops.num_seqs
        # plain Python values once per step (numpy scalar access per row is slow)
        sample_mask = ops.sample_mask[:n].tolist()
        qs = ops.cu_q_lens[:n + 1].tolist()
        sampled_list = sampled[:n].tolist()
        num_drafts = ops.draft_lens[:n].tolist()
        if any(num_drafts):
            if accepted is None:
                raise ValueError("a step with speculative drafts needs `accepted`")
            accepted_list = np.asarray(accepted)[:n].tolist()
        spec_tokens: dict[int, list[int]] = {}
        running, done = Status.RUNNING, Status.FINISHED
        applied = [True] * n
        done_running = False
        for i, (req, epoch) in enumerate(row_reqs):
            if req.status is done:
                # finished by an earlier step's token or aborted: this row's token is dropped
                applied[i] = False
                self._stats["num_dropped_tokens"] += sample_mask[i]
                continue
            live = req.epoch == epoch  # else retracted meanwhile: the KV it wrote is void
            d = num_drafts[i]
            new = [int(sampled_list[i])] if sample_mask[i] else []
            if d:  # speculative: the accepted drafts come before the device's own token
                a = int(accepted_list[i])
                if not 0 <= a <= d or len(req.drafts) != d:
                    raise ValueError(f"row {i}: accepted {a} of {d} drafts "
                                     f"({len(req.drafts)} proposed)")
                new = req.drafts[:a] + new
                req.drafts = []
                self._stats["spec_num_rows"] += 1
                self._stats["spec_draft_tokens"] += d
                self._stats["spec_accepted_tokens"] += a
            proposal, req.proposal = req.proposal, None
            if proposal is not None and live and new:
                self._check_proposal(req, proposal, new)
            if live:
                k = qs[i + 1] - qs[i]
                req.num_inflight -= k
                req.num_computed += k - d + len(new) - 1 if d else k
            if new:
                req.num_pending -= 1
                tokens = req.tokens
                stops = req.sampling.stop_token_ids
                for j, tok in enumerate(new):
                    tokens.append(tok)
                    if tok in stops:
                        req.finish_reason = "stop"
                    elif (len(tokens) - req.prompt_len >= req.max_new_tokens
                          or len(tokens) >= max_len):
                        req.finish_reason = "length"
                    else:
                        continue
                    del new[j + 1:]  # nothing past a stop or the length limit
                    break
                if d:
                    spec_tokens[i] = new
            # roll the rejected drafts' positions back: tail_avail, and pages they alone took;
            # the device row still lists dropped pages: it refreshes whole next time
            if (d and live and req.status is running and req.finish_reason is None
                    and self.coord.truncate(cast("list[BlockTable]", req.tables),
                                            req.num_computed)):
                req.needs_refresh = True
            if live and req.num_computed // base > req.published_base_pages:
                self._publish(req, req.num_computed)
            if req.finish_reason is not None:
                if req.status is running:
                    self._release(req)
                    done_running = True
                elif req.status is Status.FINISHING:  # released when the step was planned
                    self._num_finishing -= 1
                else:  # retracted while its last token was in flight
                    assert not live, "a waiting request cannot own a live row"
                    self._waiting.remove(req)
                req.status = done
                del self._requests[req.request_id]
                finished.append(req.output())
        if done_running:
            self._running = [r for r in self._running if r.status is running]
        if self.mirror_checker is not None:
            self.check_invariants()
        return StepUpdate(finished, applied, spec_tokens)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        pool = self.pool
        per_group = [0] * self._num_groups
        for req in self._running:
            for g, t in enumerate(cast("list[BlockTable]", req.tables)):
                per_group[g] += sum(1 for p in t.pages if p)
        out: dict[str, Any] = dict(self._stats)
        out.update(free_pages=pool.num_free, total_pages=pool.num_pages - 1,
                   used_pages=pool.num_used, reserved_pages=self._admission.reserved_total,
                   num_running=len(self._running), num_waiting=len(self._waiting),
                   num_evictions=pool.num_evictions,
                   group_pages={s.group_id: n for s, n in
                                zip(cast("list[PagedCacheGroupSpec]", self.config.groups), per_group)})
        q = out["prefix_query_tokens"]
        out["prefix_hit_rate"] = out["prefix_hit_tokens"] / q if q else 0.0
        if self._spec is not None:
            drafted, rows = out["spec_draft_tokens"], out["spec_num_rows"]
            out["spec_acceptance_rate"] = out["spec_accepted_tokens"] / drafted if drafted else 0.0
            # tokens one speculative row yields: accepted drafts + the device's own token
            out["spec_mean_accepted_len"] = ((out["spec_accepted_tokens"] + rows) / rows
                                             if rows else 0.0)
        if self.mirror_checker is not None:
            out["tail_only_divergences"] = self.mirror_checker.tail_only_divergences
        return out

    def authoritative_rows(self) -> dict[int, list[list[int]]]:
        """slot -> per-group page rows of every running request (for checks and tests)."""
        return {r.slot: [t.page_ids() for t in cast("list[BlockTable]", r.tables)] for r in self._running}

    def check_invariants(self) -> None:
        """Raise AssertionError unless: slots are unique and accounted for; waiting and
        finishing requests hold nothing; the pages and reservations of the running requests add
        up (`Admission.check_invariants`). Debug mode runs it after every schedule and update."""
        slots = set()
        for req in self._running:
            assert req.status is Status.RUNNING and req.tables is not None
            assert req.slot not in slots, f"slot {req.slot} used twice"
            slots.add(req.slot)
        for req in self._waiting:
            assert req.tables is None and req.slot == -1 and req.reserved == 0
        finishing = [r for r in self._requests.values() if r.status is Status.FINISHING]
        for req in finishing:  # released at plan time: only its last token is still to come
            assert req.tables is None and req.slot == -1 and req.num_pending >= 1
        assert len(finishing) == self._num_finishing, "finishing count drifted"
        assert not slots & set(self._free_slots), "a live slot is also free"
        assert len(slots) + len(self._free_slots) == self.config.num_live_slots
        self._admission.check_invariants(self._running)
