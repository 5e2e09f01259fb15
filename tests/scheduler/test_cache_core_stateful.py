"""Hypothesis stateful test of the cache core: random acquire / reclaim / match+claim / publish /
free over several groups and tables, with pool invariants checked after every rule."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler import BlockPool, CacheCoordinator, PagedCacheGroupSpec
from scheduler.hashing import PrefixHasher

SPECS = [
    PagedCacheGroupSpec("full", "full_history", 4, 1, None),
    PagedCacheGroupSpec("swa", "sliding_window", 4, 1, 6),
    PagedCacheGroupSpec("conv", "sliding_window", 2, 1, 3, live_tail_alloc=True),
]
VOCAB = [1, 2]  # a tiny alphabet makes shared prefixes (cache hits) frequent


class CacheCoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(48)
        self.coord = CacheCoordinator(SPECS, self.pool)
        self.live: list[dict] = []  # each: tables, tokens, computed, hasher

    def _refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for r in self.live:
            for t in r["tables"]:
                for p in t.pages:
                    if p:
                        refs[p] = refs.get(p, 0) + 1
        return refs

    @rule(tokens=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=24))
    def admit(self, tokens):
        hasher = PrefixHasher(self.coord.base)
        hasher.extend(tokens)
        tables = self.coord.new_tables()
        hit, rows = self.coord.match_prefix(hasher.hashes, len(tokens) - 1)
        assert hit % self.coord.lcm == 0 and hit <= len(tokens) - 1
        if hit:
            before = self.pool.num_free
            pulled = self.coord.prefix_pages_in_free_list(rows)
            self.coord.claim_prefix(tables, hit, rows)
            assert (before - self.pool.num_free,) == pulled
        self.live.append(dict(tables=tables, tokens=tokens, computed=hit, hasher=hasher))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 12))
    def acquire_and_publish(self, data, n):
        r = data.draw(st.sampled_from(self.live))
        n = min(n, len(r["tokens"]) - r["computed"])
        if n <= 0:
            return
        self.coord.reclaim(r["tables"], r["computed"])
        predicted = self.coord.blocks_needed_for(r["tables"], n)
        before = self.pool.num_free
        ok = self.coord.acquire(r["tables"], n)
        if ok:
            assert before - self.pool.num_free == predicted
            r["computed"] += n
            self.coord.publish(r["tables"], r["hasher"].hashes, r["computed"])
        else:
            assert predicted > before and self.pool.num_free == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def reclaim(self, data):
        r = data.draw(st.sampled_from(self.live))
        others = self._refs()
        for t in r["tables"]:
            for p in t.pages:
                if p:
                    others[p] -= 1
        predicted = self.coord.blocks_reclaimable_at(r["tables"], r["computed"])
        before = self.pool.num_free
        holes = self.coord.reclaim(r["tables"], r["computed"])
        assert self.pool.num_free - before == predicted
        for g, slots in enumerate(holes):
            assert all(r["tables"][g].pages[s] == 0 for s in slots)
        # pages another table still references never reach the free list
        for page, count in others.items():
            if count > 0:
                assert not self.pool.is_free(page)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        r = data.draw(st.sampled_from(self.live))
        self.live.remove(r)
        self.coord.free(r["tables"])

    @invariant()
    def pool_consistent(self):
        self.pool.check_invariants(self._refs())
        for r in self.live:
            for m, t in zip(self.coord.managers, r["tables"]):
                assert t.extent_tokens(m.page_size) == r["computed"] or not t.pages


TestCacheCore = CacheCoreMachine.TestCase
TestCacheCore.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
