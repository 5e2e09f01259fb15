"""Admission control over the page pool: which request may take pages now, and how many.

`Admission.fit` decides whether a waiting request's first chunk fits (prefix match, decode
reservation, and headroom for the pages running decoders need next step:
`pending_decode_growth`) and `admit` gives it the pages, as mini-sglang's prefill manager does
for its prefill batch. Every row, running or new, takes its pages through `acquire_row`, which
also decides whether the row sends a tail delta or refreshes its device row whole (DESIGN §6).
`Admission` keeps the reservation ledger (pages promised to a request's next acquire, per pool:
every count here is a tuple with one entry per pool of `CacheCoordinator.pools`); the
`Scheduler` keeps the policy (row order, retraction victims, slots, lifecycle) and passes in the
requests it means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import cast

from scheduler.block_table import BlockTable
from scheduler.config import SchedulerConfig
from scheduler.coordinator import CacheCoordinator, fits
from scheduler.hashing import PrefixHasher
from scheduler.ops_builder import ScheduledRow
from scheduler.request import Request
from scheduler.step_ops import GroupLayout


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A waiting request that fits the pool now (`Admission.fit`)."""

    tables: list[BlockTable]  # its fresh tables, the prefix pages claimed
    hit: int  # prompt tokens served by the prefix cache
    num_tokens: int  # its first chunk
    reserve: tuple[int, ...]  # pages reserved for its decodes after the chunk, per pool
    host_hit: int = 0  # of `hit`, tokens the host tier served (loaded, not recomputed)


def check_prompt(prompt_token_ids: list[int], max_new_tokens: int, max_context_len: int) -> list[int]:
    """The prompt as ints; ValueError naming the problem when it is empty, has a negative id,
    or cannot fit `max_context_len` with `max_new_tokens` (such a request is never admitted)."""
    prompt = [int(t) for t in prompt_token_ids]
    if not prompt:
        raise ValueError("empty prompt")
    if min(prompt) < 0:
        raise ValueError(f"negative token id {min(prompt)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    total = len(prompt) + max_new_tokens
    if total > max_context_len:
        raise ValueError(
            f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds max_context_len {max_context_len}"
        )
    return prompt


def add(*counts: tuple[int, ...]) -> tuple[int, ...]:
    """Per-pool counts added entry by entry."""
    return tuple(map(sum, zip(*counts)))


def sub(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if len(a) == 1:  # one shared pool (the hot path)
        return (a[0] - b[0],)
    return tuple(x - y for x, y in zip(a, b))


def requeue(waiting: list[Request], req: Request) -> None:
    """Put a retracted request back: retracted requests resume before new arrivals, oldest
    first (the waiting queue is served in order, FCFS)."""
    pos = 0
    while pos < len(waiting) and waiting[pos].num_retractions > 0 and waiting[pos].arrival < req.arrival:
        pos += 1
    waiting.insert(pos, req)


class Admission:
    """One scheduler's admission control (see the module docstring)."""

    def __init__(
        self, config: SchedulerConfig, coord: CacheCoordinator, layouts: Sequence[GroupLayout]
    ) -> None:
        self.config = config
        self.coord = coord
        self.layouts = layouts
        self.chunk_cap = config.max_prefill_chunk_tokens or config.max_scheduled_tokens
        self.none = (0,) * len(coord.pools)  # no pages, per pool
        self.reserved_total = self.none  # the sum of every running request's `reserved`

    # ------------------------------------------------------------------ reservations
    def available_for(self, req: Request) -> tuple[int, ...]:
        """Free pages `req` may take: all but those promised to the other requests."""
        others = sub(self.reserved_total, req.reserved) if req.reserved else self.reserved_total
        return sub(self.coord.free_pages(), others)

    def has_room(self) -> bool:
        """Whether the free pages cover every reservation (no acquire has to wait for one)."""
        return fits(self.reserved_total, self.coord.free_pages())

    def reserve(self, req: Request, n: tuple[int, ...]) -> None:
        """Promise `n` free pages to `req`'s next acquire (admission keeps them for its decodes)."""
        self.settle(req)
        if any(n):
            self.reserved_total = add(self.reserved_total, n)
            req.reserved = n

    def settle(self, req: Request) -> None:
        """Drop `req`'s reservation: its acquire used the pages, or it gave everything back."""
        if req.reserved:
            self.reserved_total = sub(self.reserved_total, req.reserved)
            req.reserved = ()

    # ------------------------------------------------------------------ waiting requests
    def fit(
        self,
        req: Request,
        budget: int,
        headroom: tuple[int, ...],
        sizer: Callable[[int], int] | None = None,
    ) -> Admitted | None:
        """Whether the waiting `req` can start now with at most `budget` tokens, keeping
        `headroom` pages free for the running decoders; if so, claim its prefix pages.
        sizer: maps the first chunk's length to the one to schedule (`bucket_fit.fit_chunk`)."""
        cfg, coord = self.config, self.coord
        hit, hit_rows = 0, None
        sampling = req.sampling
        if cfg.enable_prefix_cache and not sampling.prompt_logprobs and not sampling.has_penalties:
            hit, hit_rows = coord.match_prefix(req.hasher.hashes, len(req.tokens) - 1)
        tables = coord.new_tables()
        if hit:
            for t, hit_row in zip(tables, cast("list[list[int]]", hit_rows)):
                t.pages = list(hit_row)  # shape only: demand math needs the table length
        n = min(len(req.tokens) - hit, budget, self.chunk_cap)
        if sizer is not None:
            n = sizer(n)
        # Reserve decode room only for tokens the request can still generate: the fit check in
        # add_request sizes a request by prompt + max_new_tokens, so reserving more than that
        # could make a request that fits alone unadmittable forever (a liveness bug).
        left = req.max_new_tokens - req.num_generated
        extra = min(cfg.decode_reserve_tokens, left) if n == len(req.tokens) - hit else 0
        chunk_need = coord.pages_needed(tables, n)
        reserve = sub(coord.pages_needed_sequential(tables, n, extra), chunk_need)
        pulled = coord.prefix_pages_in_free_list(cast("list[list[int]]", hit_rows)) if hit else self.none
        room = sub(coord.free_pages(), self.reserved_total)
        if not fits(add(chunk_need, reserve, pulled, headroom), room):
            return None
        host_hit = 0
        if hit:
            rows = cast("list[list[int]]", hit_rows)
            if any(p < 0 for row in rows for p in row):  # host hits: the device alone gives less
                host_hit = hit - coord.match_prefix(req.hasher.hashes, len(req.tokens) - 1, use_host=False)[0]
            for t in tables:
                t.pages = []
            coord.claim_prefix(tables, hit, rows)
        return Admitted(tables, hit, n, reserve, host_hit)

    def admit(self, req: Request, fit: Admitted) -> ScheduledRow:
        """Give `req` (bound to its slot) the tables `fit` claimed; acquire its first chunk and
        reserve its decode pages."""
        req.tables = fit.tables
        req.num_computed = fit.hit
        req.prefill_done = False
        req.num_decode_rows = 0
        req.published_base_pages = fit.hit // self.coord.base
        if not req.admitted_once:
            req.admitted_once = True
            req.num_cached_tokens = fit.hit
        row = self.acquire_row(req, fit.num_tokens, [[] for _ in fit.tables])
        self.reserve(req, fit.reserve)
        return row

    def prefix_match_tokens(self, prompt_token_ids: list[int], cache_salt: bytes = b"") -> int:
        """Prompt tokens a new request would take from the prefix cache right now (read-only)."""
        if not self.config.enable_prefix_cache or len(prompt_token_ids) < 2:
            return 0
        hasher = PrefixHasher(self.coord.base, cache_salt)
        hasher.extend(list(prompt_token_ids))
        hit, _ = self.coord.match_prefix(hasher.hashes, len(prompt_token_ids) - 1)
        return hit

    def pending_decode_growth(self, running: Iterable[Request]) -> tuple[int, ...]:
        """Pages the `running` decoders will need next step if they sit at a page boundary:
        admission keeps them free so a new request does not force a retraction one step later."""
        coord = self.coord
        total = self.none
        max_len = self.config.max_context_len
        for r in running:
            if r.num_pending and r.finishes_by_length(max_len):
                continue  # planned no more
            if r.prefill_done and not r.reserved:
                for t in r.held_tables:
                    if t.tail_avail < 1:  # only then can one more token need a page
                        total = add(total, coord.pages_needed(r.held_tables, 1))
                        break
        return total

    # ------------------------------------------------------------------ every row
    def acquire_row(
        self, req: Request, n: int, holes: list[list[int]], samples: bool | None = None
    ) -> ScheduledRow:
        """Acquire the pages of `req`'s next `n` tokens (the caller made room: `available_for`)
        and describe the row; `holes` are the slots reclaim punched for it. samples: whether the
        row samples (None: iff it reaches the end of the request's tokens; a speculative row
        runs past them and samples)."""
        tables = req.held_tables  # running: set
        begins = [len(t.pages) for t in tables]
        ok = self.coord.acquire(tables, n, available=self.available_for(req))
        assert ok, "acquire failed after the availability check"
        self.settle(req)
        sizes = [len(t.pages) - b for t, b in zip(tables, begins)]
        if samples is None:
            samples = n == req.remaining
        refresh = self.needs_full_refresh(req, holes)
        if req.prefill_done:
            req.num_decode_rows += 1
        else:
            req.prefill_done = samples
        req.needs_refresh = False
        return ScheduledRow(
            req=req,
            start=req.num_scheduled,
            num_tokens=n,
            full_refresh=refresh,
            samples=samples,
            begins=begins,
            sizes=sizes,
            holes=holes,
        )

    def needs_full_refresh(self, req: Request, holes: list[list[int]]) -> bool:
        r"""Whether this row must rewrite the request's device row whole (DESIGN §6). Decided
        before `acquire_row` updates the request's counters. One group g, page size B:

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
        hot path and sends the delta only (the decode fast path of `Scheduler.schedule` is that
        case).
        """
        if not req.prefill_done:  # (a), and continuation chunks
            return True
        if req.needs_refresh or req.num_decode_rows == 0:  # (b), first decode after prefill
            return True
        return any(len(h) > lay.delta_width for h, lay in zip(holes, self.layouts))  # (c)

    def check_invariants(self, running: Iterable[Request]) -> None:
        """Raise AssertionError unless the reservations of `running` (every running request)
        add up and every page's refcount equals the references their tables hold (no page both
        free and referenced, free + referenced == num_pages - 1, page 0 never free or cached)."""
        pools = self.coord.pools
        refs: list[dict[int, int]] = [{} for _ in pools]
        reserved = self.none
        for req in running:
            if req.reserved:
                assert any(req.reserved), "an all-zero reservation must be ()"
                reserved = add(reserved, req.reserved)
            for t, i in zip(req.held_tables, self.coord.pool_index):
                pool_refs = refs[i]
                for p in t.pages:
                    if p:
                        pool_refs[p] = pool_refs.get(p, 0) + 1
        assert reserved == self.reserved_total, "reservation bookkeeping drifted"
        for pool, pool_refs in zip(pools, refs):
            pool.check_invariants(pool_refs)
