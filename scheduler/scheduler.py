"""`Scheduler`: request lifecycle, chunked prefill, prefix cache, retraction, StepOps (DESIGN §4-6).

One step: `schedule()` decides every row (running requests first, in admission order, then
waiting ones), applying per request the transition order publish -> reclaim -> acquire; the device
runs the returned `StepOps`; `update(ops, sampled)` appends tokens, finishes requests and publishes
completed pages (adopting canonical copies). Retraction victim policy: the most recently admitted
running request (LIFO), so the oldest requests always make progress.

Overlapped scheduling (plan ahead): `schedule()` may be called again before the previous step's
`update()` (one step in flight; `update` must then come in schedule order). A row whose input is
the token sampled by the step in flight carries a placeholder (`PLACEHOLDER_TOKEN`) with
`token_from_prev` set, and the device reads the id it kept for that slot. Pages are handed out
early where that is exact: whoever gets a page from a later `schedule()` is in a step the device
runs after the step still using it (steps execute in dispatch order).
  - Publish: the pages the step in flight completes are published when the next step is planned
    (their tokens are its inputs, all known), as the synchronous loop's `update` would have done
    by then, so prefix hits do not lag.
  - Stop token: a request that may finish in the step in flight is planned again; if it does,
    `update` drops the extra row's token (never returned) and frees its pages at once.
  - Length: a request whose pending token certainly ends it (max_new_tokens / context limit) is
    not planned again; the next `schedule()` releases its pages and slot right away
    (`Status.FINISHING`), so the requests behind it are admitted in the same step as in the
    synchronous loop; `update` only appends the last token.
  - Retraction and abort of a request with a row in flight bump its `epoch`: `update` then ignores
    that row's KV (its pages are gone) but still appends a sampled token (it is real output); a
    retracted request re-enters only once its pending token has landed (its slot's device copy
    is no longer its own).
  - Reclaim: slid-out sliding-window / conv slots are reclaimed at the same extent as the publish
    (the scheduled one when its tokens are known), after it, so a punched page keeps its hash and
    the pool holds what the synchronous loop's would.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, cast

import numpy as np

from scheduler.block_pool import BlockPool
from scheduler.block_table import BlockTable
from scheduler.config import SchedulerConfig
from scheduler.coordinator import CacheCoordinator
from scheduler.group_spec import PagedCacheGroupSpec
from scheduler.hashing import PrefixHasher
from scheduler.invariants import check_scheduler_invariants
from scheduler.mirror_check import MirrorChecker
from scheduler.ops_builder import OpsBuilder, ScheduledRow
from scheduler.request import Request, RequestOutput, Status
from scheduler.step_ops import LOGIT_BIAS_WIDTH, PLACEHOLDER_TOKEN, StepOps


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
        self._reserved_total = 0
        self._num_finishing = 0  # Status.FINISHING: released, last token still in flight
        self._chunk_cap = config.max_prefill_chunk_tokens or config.max_scheduled_tokens
        self._num_groups = len(cast("list[PagedCacheGroupSpec]", config.groups))
        # shared (never mutated) per-group values of a fast-path decode row
        self._no_sizes = [0] * self._num_groups
        self._no_holes: list[list[int]] = [[] for _ in range(self._num_groups)]
        # False: every row takes the general path and `build` (tests compare the two)
        self.decode_fast_path = True
        self._stats = {"num_retractions": 0, "prefix_hit_tokens": 0, "prefix_query_tokens": 0,
                       "adopted_pages": 0, "num_steps": 0, "num_aborted": 0,
                       "num_full_refresh_rows": 0, "num_dropped_tokens": 0}
        # steps scheduled but not yet fed back: (ops, [(request, epoch) per row]), oldest first
        self._flights: collections.deque[tuple[StepOps, list[tuple[Request, int]]]] = (
            collections.deque())
        # after each update: per row of that step, whether its result was applied (False for
        # rows of requests that had finished or been aborted meanwhile); the engine routes
        # logprobs by it
        self.last_update_rows: list[bool] = []
        self.mirror_checker = MirrorChecker(self) if config.debug_checks else None

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], max_new_tokens: int,
                    **options: Any) -> None:
        """Queue a request. Options: stop_token_ids, temperature (0 = greedy), top_p, top_k,
        seed, prompt_logprobs (bool), cache_salt (str | bytes), presence_penalty,
        frequency_penalty, repetition_penalty, logit_bias, top_logprobs. Raises ValueError on bad input
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
        req = Request.from_options(request_id, prompt, max_new_tokens, options,
                                   arrival=next(self._arrival), hash_base=self.coord.base)
        if len(req.logit_bias) > LOGIT_BIAS_WIDTH:
            raise ValueError(f"request {request_id!r}: {len(req.logit_bias)} logit_bias entries, "
                             f"at most {LOGIT_BIAS_WIDTH}")
        self._requests[request_id] = req
        self._waiting.append(req)

    def check_prompt(self, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
        """The prompt as ints; ValueError naming the problem when it is empty, has a negative
        id, or cannot fit max_context_len with max_new_tokens (the engine validates with it)."""
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("empty prompt")
        if min(prompt) < 0:
            raise ValueError(f"negative token id {min(prompt)}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        total, limit = len(prompt) + max_new_tokens, self.config.max_context_len
        if total > limit:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) = {total} "
                             f"exceeds max_context_len {limit}")
        return prompt

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

    def prefix_match_tokens(self, prompt_token_ids: list[int], cache_salt: bytes = b"") -> int:
        """Prompt tokens a new request would take from the prefix cache right now (read-only;
        data-parallel routing sends a request to the replica with the longest match)."""
        if not self.config.enable_prefix_cache or len(prompt_token_ids) < 2:
            return 0
        hasher = PrefixHasher(self.coord.base, cache_salt)
        hasher.extend(list(prompt_token_ids))
        hit, _ = self.coord.match_prefix(hasher.hashes, len(prompt_token_ids) - 1)
        return hit

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepOps:
        cfg = self.config
        budget = cfg.max_scheduled_tokens
        # rows in order; a plain decode (fast path) is recorded as its Request alone; every
        # one-token decode row has its StepOps inputs in the column lists below (slot, start,
        # input token), so an all-decode step needs no `ScheduledRow` per plain row
        rows: list[ScheduledRow | Request] = []
        slots: list[int] = []
        starts: list[int] = []
        toks: list[int] = []
        busy: list[tuple[int, ScheduledRow]] = []  # decode rows with group deltas
        general = extras = False  # some row is no decode / needs the extra fields
        max_rows = cfg.max_batch_requests
        i = 0
        running, pool, coord = self._running, self.pool, self.coord
        base = coord.base
        fast = self.decode_fast_path
        max_len = cfg.max_context_len
        ending: set[Request] = set()  # their token in flight ends them: nothing to plan
        if self._flights:
            # Overlapped: release them before anything below allocates, as the synchronous
            # loop's update would have (when every token the steps in flight compute for them is
            # known, i.e. one step ahead; planned further ahead, `update` releases them)
            ends = [r for r in running if r.num_pending and r.finishes_by_length(max_len)]
            if ends:
                for r in ends:  # in running order: the freed slots' order is deterministic
                    if r.num_computed + r.num_inflight <= len(r.tokens):
                        self._release_finishing(r)
                    else:
                        ending.add(r)
                self._running = running = [r for r in running if r.status is Status.RUNNING]
        room = pool.num_free >= self._reserved_total  # changes only on the general path
        while i < len(running) and len(rows) < max_rows and budget > 0:
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
            if extent // base > req.published_base_pages:
                # pages the step in flight completes (their tokens are its inputs): publish them
                # now, as the synchronous loop's update would have before this schedule, so
                # prefix hits do not lag a step. Whoever hits them runs later.
                self._publish(req, extent)
                room = pool.num_free >= self._reserved_total  # adoption frees private copies
            # Decode fast path: one token, no refresh, room in every tail, nothing to reclaim
            # and no reservation shortfall. Exactly what the general path below would decide.
            if (fast and room and req.num_decode_rows and not req.needs_refresh
                    and not req.reserved and req.prefill_done
                    and len(tokens) + pending - start == 1
                    and coord.grow_in_tail(cast("list[BlockTable]", req.tables), extent)):
                req.num_decode_rows += 1
                rows.append(req)
                slots.append(req.slot)
                starts.append(start)
                # the input is the last known token, or the one the step in flight samples
                toks.append(PLACEHOLDER_TOKEN if pending else tokens[-1])
                extras = extras or req.needs_extras
                budget -= 1
                i += 1
                continue
            row = self._schedule_running(req, budget, extent)
            room = pool.num_free >= self._reserved_total
            if row is None:  # req itself was retracted (it was the LIFO victim)
                continue
            if fast and row.num_tokens == 1 and row.samples and not row.full_refresh:
                # a decode that took a page or punched a hole: still one column of the
                # decode builder, plus its group deltas
                busy.append((len(rows), row))
                slots.append(req.slot)
                starts.append(row.start)
                toks.append(tokens[row.start] if row.start < len(tokens) else PLACEHOLDER_TOKEN)
                extras = extras or req.needs_extras
            else:
                general = True
            rows.append(row)
            budget -= row.num_tokens
            i += 1
        headroom = -1  # computed at the first admission attempt (O(running); a full batch
        # with a waiting queue, the common decode case, never needs it)
        while self._waiting and len(rows) < max_rows and budget > 0 and self._free_slots:
            head = self._waiting[0]
            if head.num_pending:
                break  # retracted with a token in flight: it resumes once the token has landed
            if headroom < 0:
                headroom = self._pending_decode_growth()
            row = self._admit(head, budget, headroom)
            if row is None:
                break  # FCFS: the head waits for memory, nobody overtakes it
            self._waiting.pop(0)
            general = True
            rows.append(row)
            budget -= row.num_tokens
        if not general:  # every row a one-token decode (or none): numpy over the slot arrays
            reqs = [row if isinstance(row, Request) else row.req for row in rows]
            ops = self._builder.build_decode(reqs, slots, starts, toks, extras, busy)
            for req in reqs:
                req.num_inflight += 1
                req.num_pending += 1
            flight = [(req, req.epoch) for req in reqs]
        else:
            # counters are untouched until after build, so num_scheduled is still the start
            built = [ScheduledRow(req=row, start=row.num_scheduled, num_tokens=1,
                                  full_refresh=False, samples=True, begins=None,
                                  sizes=self._no_sizes, holes=self._no_holes, plain=True)
                     if isinstance(row, Request) else row for row in rows]
            ops = self._builder.build(built)
            for row in built:  # after build: the builder reads the pre-step counters
                req = row.req
                req.num_inflight += row.num_tokens
                if row.samples:
                    req.num_pending += 1
            flight = [(row.req, row.req.epoch) for row in built]
        if rows:
            self._flights.append((ops, flight))
        self._stats["num_steps"] += 1
        if general:
            self._stats["num_full_refresh_rows"] += int(ops.full_refresh.sum())
        if self.mirror_checker is not None:
            self.mirror_checker.apply(ops)
            self.check_invariants()
        return ops

    def _schedule_running(self, req: Request, budget: int, extent: int) -> ScheduledRow | None:
        coord = self.coord
        n = min(req.remaining, budget, self._chunk_cap)
        tables = cast("list[BlockTable]", req.tables)  # running: set
        # Reclaim at `extent`, whose pages are already published (same hashes as the synchronous
        # loop). With a step in flight that is its scheduled extent: a slot that step still reads
        # may be freed now, as whoever gets the page is in a later step, which runs after it.
        holes = coord.reclaim(tables, extent)
        need = coord.blocks_needed_for(tables, n)
        while need > self._available_for(req):
            victim = self._running[-1]
            self._retract(victim)
            if victim is req:
                return None
        return self._acquire_row(req, n, holes)

    def _available_for(self, req: Request) -> int:
        return self.pool.num_free - (self._reserved_total - req.reserved)

    def _needs_full_refresh(self, req: Request, holes: list[list[int]]) -> bool:
        r"""Whether this row must rewrite the request's device row whole (DESIGN §6). Decided
        before `_acquire_row` updates the request's counters. One group g, page size B:

            tokens  0                          start = num_scheduled               start + n
                    |--- cached, computed or in flight ---|------ this row's n tokens ------|
            columns | 0 | 1 | ... | begins[g] - 1 |  begins[g] | ... | begins + sizes[g] - 1 |
                    \____ held before this row _____/  \___ acquired now = the tail delta ___/
                    (the row's first tokens may fill the free tail of the last held page)

        A tail delta writes only the right-hand columns (+ `hole_slots`), so it is correct only
        when every column left of begins[g] is already right on the device. That fails when:
          (a) the device row is not this request's yet: a first prefill chunk (its slot, just
              taken from the free list, holds a previous occupant's ids, and a prefix hit claims
              columns [0, hit / B) that no delta carries), a retracted request resuming;
          (b) publish adopted canonical copies and so repointed columns left of begins
              (`needs_refresh`; the seed's aliasing bug: the freed private copy comes back as
              the next tail page, and a tail-only mirror maps two columns to it);
          (c) reclaim punched more holes this step than `hole_slots` (N_g columns) can carry.
        Continuation prefill chunks and the first decode after prefill refresh too, as DESIGN §6
        prescribes: a prefill row costs O(chunk) compute, its O(W) row copy is noise, and the
        rule needs no proof that nothing moved at chunk boundaries. Plain decode -> decode is the
        hot path and sends the delta only (the decode fast path in `schedule` is that case).
        """
        if not req.prefill_done:  # (a), and continuation chunks
            return True
        if req.needs_refresh or req.num_decode_rows == 0:  # (b), first decode after prefill
            return True
        return any(len(h) > lay.delta_width for h, lay in zip(holes, self.layouts))  # (c)

    def _acquire_row(self, req: Request, n: int, holes: list[list[int]]) -> ScheduledRow:
        tables = cast("list[BlockTable]", req.tables)  # running: set
        begins = [len(t.pages) for t in tables]
        ok = self.coord.acquire(tables, n, available=self._available_for(req))
        assert ok, "acquire failed after the availability check"
        self._reserved_total -= req.reserved
        req.reserved = 0
        sizes = [len(t.pages) - b for t, b in zip(tables, begins)]
        samples = n == req.remaining
        refresh = self._needs_full_refresh(req, holes)
        if req.prefill_done:
            req.num_decode_rows += 1
        else:
            req.prefill_done = samples
        req.needs_refresh = False
        return ScheduledRow(req=req, start=req.num_scheduled, num_tokens=n, full_refresh=refresh,
                            samples=samples, begins=begins, sizes=sizes, holes=holes)

    def _admit(self, req: Request, budget: int, headroom: int) -> ScheduledRow | None:
        cfg, coord = self.config, self.coord
        hit, hit_rows = 0, None
        if cfg.enable_prefix_cache and not req.prompt_logprobs and not req.has_penalties:
            hit, hit_rows = coord.match_prefix(req.hasher.hashes, len(req.tokens) - 1)
        tables = coord.new_tables()
        if hit:
            for t, hit_row in zip(tables, cast("list[list[int]]", hit_rows)):
                t.pages = list(hit_row)  # shape only: demand math needs the table length
        n = min(len(req.tokens) - hit, budget, self._chunk_cap)
        # Reserve decode room only for tokens the request can still generate: the fit check in
        # add_request sizes a request by prompt + max_new_tokens, so reserving more than that
        # could make a request that fits alone unadmittable forever (a liveness bug).
        left = req.max_new_tokens - req.num_generated
        extra = min(cfg.decode_reserve_tokens, left) if n == len(req.tokens) - hit else 0
        chunk_need = coord.blocks_needed_for(tables, n)
        reserve = coord.blocks_needed_for_sequential(tables, n, extra) - chunk_need
        pulled = coord.prefix_pages_in_free_list(cast("list[list[int]]", hit_rows)) if hit else 0
        if chunk_need + reserve + pulled + headroom > (
                self.pool.num_free - self._reserved_total):
            return None
        if hit:
            for t in tables:
                t.pages = []
            coord.claim_prefix(tables, hit, cast("list[list[int]]", hit_rows))
        req.tables = tables
        req.num_computed = hit
        req.slot = self._free_slots.pop()
        self._builder.bind(req)
        req.status = Status.RUNNING
        req.prefill_done = False
        req.num_decode_rows = 0
        req.published_base_pages = hit // coord.base
        if not req.admitted_once:
            req.admitted_once = True
            req.num_cached_tokens = hit
            self._stats["prefix_hit_tokens"] += hit
            self._stats["prefix_query_tokens"] += req.prompt_len
        req.reserved = 0
        self._running.append(req)
        row = self._acquire_row(req, n, [[] for _ in tables])
        req.reserved = reserve
        self._reserved_total += reserve
        return row

    def _pending_decode_growth(self) -> int:
        """Pages running decoders will need next step if they sit at a page boundary: admission
        keeps them free so a new request does not force a retraction one step later."""
        coord = self.coord
        total = 0
        max_len = self.config.max_context_len
        for r in self._running:
            if r.num_pending and r.finishes_by_length(max_len):
                continue  # planned no more
            if r.prefill_done and r.reserved == 0:
                for t in cast("list[BlockTable]", r.tables):
                    if t.tail_avail < 1:  # only then can one more token need a page
                        total += coord.blocks_needed_for(cast("list[BlockTable]", r.tables), 1)
                        break
        return total

    # ------------------------------------------------------------------ retraction / release
    def _retract(self, req: Request) -> None:
        self._release(req)
        self._running.remove(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_retractions += 1
        self._stats["num_retractions"] += 1
        # retracted requests resume before new arrivals, oldest first
        pos = 0
        while (pos < len(self._waiting) and self._waiting[pos].num_retractions > 0
               and self._waiting[pos].arrival < req.arrival):
            pos += 1
        self._waiting.insert(pos, req)

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

    def _release(self, req: Request) -> None:
        self.coord.free(cast("list[BlockTable]", req.tables))
        req.tables = None
        self._free_slots.append(req.slot)
        req.slot = -1
        self._reserved_total -= req.reserved
        req.reserved = 0
        req.needs_refresh = True
        req.prefill_done = False
        req.num_decode_rows = 0
        req.num_inflight = 0  # whatever a step in flight computes for it is void now
        req.epoch += 1

    # ------------------------------------------------------------------ update
    def update(self, ops: StepOps, sampled_token_ids: np.ndarray) -> list[RequestOutput]:
        """Feed back one step: `sampled_token_ids` i32[max_batch_requests], entry i for row i.

        Steps must be fed back in the order they were scheduled (at most the in-flight ones).
        Returns the requests that finished in this step."""
        sampled = np.asarray(sampled_token_ids)
        if sampled.shape[0] < ops.num_seqs:
            raise ValueError(f"{sampled.shape=} has fewer entries than the step's {ops.num_seqs} rows")
        if ops.num_seqs == 0:
            self.last_update_rows = []
            return []  # an empty step is never recorded (nothing ran)
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
            if live:
                k = qs[i + 1] - qs[i]
                req.num_inflight -= k
                req.num_computed += k
            if sample_mask[i]:
                req.num_pending -= 1
                tok = int(sampled_list[i])
                tokens = req.tokens
                tokens.append(tok)
                if tok in req.stop_token_ids:
                    req.finish_reason = "stop"
                elif (len(tokens) - req.prompt_len >= req.max_new_tokens
                      or len(tokens) >= max_len):
                    req.finish_reason = "length"
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
        self.last_update_rows = applied
        if self.mirror_checker is not None:
            self.check_invariants()
        return finished

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        pool = self.pool
        per_group = [0] * self._num_groups
        for req in self._running:
            for g, t in enumerate(cast("list[BlockTable]", req.tables)):
                per_group[g] += sum(1 for p in t.pages if p)
        out: dict[str, Any] = dict(self._stats)
        out.update(free_pages=pool.num_free, total_pages=pool.num_pages - 1,
                   used_pages=pool.num_used, reserved_pages=self._reserved_total,
                   num_running=len(self._running), num_waiting=len(self._waiting),
                   num_evictions=pool.num_evictions,
                   group_pages={s.group_id: n for s, n in
                                zip(cast("list[PagedCacheGroupSpec]", self.config.groups), per_group)})
        q = out["prefix_query_tokens"]
        out["prefix_hit_rate"] = out["prefix_hit_tokens"] / q if q else 0.0
        if self.mirror_checker is not None:
            out["tail_only_divergences"] = self.mirror_checker.tail_only_divergences
        return out

    def authoritative_rows(self) -> dict[int, list[list[int]]]:
        """slot -> per-group page rows of every running request (for checks and tests)."""
        return {r.slot: [t.page_ids() for t in cast("list[BlockTable]", r.tables)] for r in self._running}

    def check_invariants(self) -> None:
        """Pool/table/slot/reservation consistency; raises AssertionError (debug mode runs it
        after every schedule and update)."""
        check_scheduler_invariants(self)
