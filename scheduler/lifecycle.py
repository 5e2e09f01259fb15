"""`RequestLifecycle`: the requests' states and what each state holds (the `Scheduler`'s base).

A request is WAITING (holds nothing), RUNNING (holds cache pages, a reservation and a device
slot), FINISHING (overlapped scheduling: released, its last token still in flight) or FINISHED
(forgotten). Planning (`Scheduler.schedule`) and feedback (`Scheduler.update_step`) both move
requests between these states, and each move must take or give back exactly what the states
hold, or pages and slots leak. So every move is one method here (`add_request`, the checked
way in; `_admit`, `_retract`, `_release_finishing`, `_retire`, `abort`, over `_release`), beside
the queues, slots and counters they keep and `check_invariants`, which checks them; the
`Scheduler` decides when to move whom.
"""

from __future__ import annotations

import itertools
from typing import Any

from scheduler.admission import Admission, Admitted, check_prompt, requeue
from scheduler.block_pool import BlockPool
from scheduler.config import SchedulerConfig
from scheduler.coordinator import CacheCoordinator
from scheduler.host_tier import HostTier
from scheduler.ops_builder import OpsBuilder, ScheduledRow
from scheduler.request import Request, RequestOutput, Status
from scheduler.sampling_options import SamplingOptions


class RequestLifecycle:
    """The request states of one scheduler and their moves (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_pages)
        self.coord = CacheCoordinator(
            config.group_specs,
            self.pool,
            state_every_page=config.state_snapshots == "every_page",
            state_pool=None if config.state_pages is None else BlockPool(config.state_pages),
        )
        # the host KV tier below the pool (None: off); its copies ride on each step's StepOps
        self.host_tier = HostTier(config.host_pages, config.num_pages) if config.host_pages else None
        if self.host_tier is not None:
            self.coord.attach_host_tier(self.host_tier)
        self._builder = OpsBuilder(config)
        self.layouts = self._builder.layouts
        self._requests: dict[str, Request] = {}
        self._waiting: list[Request] = []  # retracted requests first, then arrival order
        self._running: list[Request] = []  # admission order
        self._free_slots = list(range(config.num_live_slots - 1, -1, -1))
        self._num_finishing = 0  # Status.FINISHING: released, last token still in flight
        self._admission = Admission(config, self.coord, self.layouts)  # pages and reservations
        self._num_groups = len(config.group_specs)
        self._stats = {
            "num_retractions": 0,
            "prefix_hit_tokens": 0,
            "prefix_query_tokens": 0,
            "host_hit_tokens": 0,  # the host tier's share of prefix_hit_tokens
            "resume_hit_tokens": 0,  # tokens retracted requests took back from either tier
            "adopted_pages": 0,
            "num_steps": 0,
            "num_aborted": 0,
            "num_full_refresh_rows": 0,
            "num_dropped_tokens": 0,
            "spec_num_rows": 0,
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
        }
        self._arrival = itertools.count()  # arrival order: FCFS, and retracted ones resume by it

    # ------------------------------------------------------------------ entry
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_new_tokens: int,
        *,
        sampling: SamplingOptions | None = None,
        speculate: bool = True,
        **options: Any,
    ) -> None:
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
        needs = self.coord.solo_peak_by_pool(len(prompt) + max_new_tokens, cfg.max_scheduled_tokens)
        for need, pool, name in zip(needs, self.coord.pools, ("", "state ")):
            if need > pool.num_pages - 1:
                raise ValueError(
                    f"request {request_id!r}: needs {need} {name}cache pages even alone, the "
                    f"{name}pool has {pool.num_pages - 1}"
                )
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
        speculate = (
            speculate
            and cfg.speculative is not None
            and not sampling.needs_extras
            and not sampling.prompt_logprobs
        )
        req = Request(
            request_id,
            prompt,
            max_new_tokens,
            sampling=sampling,
            cache_salt=salt,
            arrival=next(self._arrival),
            hash_base=self.coord.base,
            speculate=speculate,
        )
        self._requests[request_id] = req
        self._waiting.append(req)

    def check_prompt(self, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
        """`admission.check_prompt` under this config's max_context_len (the engine validates
        with it)."""
        return check_prompt(prompt_token_ids, max_new_tokens, self.config.max_context_len)

    # ------------------------------------------------------------------ queries
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._num_finishing)

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

    # ------------------------------------------------------------------ moves
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

    def _admit(self, req: Request, fit: Admitted) -> ScheduledRow:
        """Start a waiting request that fits: a slot, then its first chunk's row."""
        if not req.admitted_once:
            self._stats["prefix_hit_tokens"] += fit.hit
            self._stats["prefix_query_tokens"] += req.prompt_len
            self._stats["host_hit_tokens"] += fit.host_hit
        else:  # a retracted request resuming: what it did not recompute
            self._stats["resume_hit_tokens"] += fit.hit
        req.slot = self._free_slots.pop()
        self._builder.bind(req)
        req.status = Status.RUNNING
        self._running.append(req)
        return self._admission.admit(req, fit)

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

    def _retire(self, req: Request, live: bool) -> RequestOutput:
        """Finish `req` (the stop rule ended it), wherever its last token found it; its output.
        live: its row's KV still counts (else it was retracted meanwhile). A running request
        stays in the running list until the caller drops the finished ones at once."""
        if req.status is Status.RUNNING:
            self._release(req)
        elif req.status is Status.FINISHING:  # released when the step was planned
            self._num_finishing -= 1
        else:  # retracted while its last token was in flight
            assert not live, "a waiting request cannot own a live row"
            self._waiting.remove(req)
        req.status = Status.FINISHED
        del self._requests[req.request_id]
        return req.output()

    def _publish(self, req: Request, computed: int) -> None:
        """Publish the request's full base pages up to `computed` tokens (prefix cache)."""
        coord = self.coord
        if computed // coord.base <= req.published_base_pages:
            return
        req.hasher.extend(req.tokens)
        moved = coord.publish(
            req.held_tables,
            req.hasher.hashes,
            computed,
            adopt=self.config.enable_adoption,
            chunk_end=True,
        )
        req.published_base_pages = computed // coord.base
        if any(moved):
            req.needs_refresh = True
            self._stats["adopted_pages"] += sum(len(m) for m in moved)

    def _release(self, req: Request) -> None:
        self.coord.free(req.held_tables)
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

    # ------------------------------------------------------------------ checks
    def authoritative_rows(self) -> dict[int, list[list[int]]]:
        """slot -> per-group page rows of every running request (for checks and tests)."""
        return {r.slot: [t.page_ids() for t in r.held_tables] for r in self._running}

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
            assert req.tables is None and req.slot == -1 and not req.reserved
        finishing = [r for r in self._requests.values() if r.status is Status.FINISHING]
        for req in finishing:  # released at plan time: only its last token is still to come
            assert req.tables is None and req.slot == -1 and req.num_pending >= 1
        assert len(finishing) == self._num_finishing, "finishing count drifted"
        assert not slots & set(self._free_slots), "a live slot is also free"
        assert len(slots) + len(self._free_slots) == self.config.num_live_slots
        self._admission.check_invariants(self._running)
        if self.host_tier is not None:
            host = self.host_tier.pool
            host.check_invariants()
            for page in host.lru_pages():  # tiers are exclusive
                key = host.key_of(page)
                assert not self.pool.has_key(key), f"key {key!r} in both tiers"
