"""Shared pieces of the scheduler tests: a fake device, small configs, the base state machine.

`FakeDevice` is a faithful numpy model of what the runtime does with a StepOps: it applies the
page-table updates to its own mirrors, substitutes `token_from_prev` placeholders with the last
token it sampled for that slot, writes every input token id into the page of the full-history
group its mirror points at, and "samples" a hash of the whole context read back through that
mirror. A wrong page table, a page freed and reused too early, a wrong placeholder or a stale
slot all change the context it reads, so the tokens diverge from a correct run.

`SchedulerMachine` is the hypothesis state machine of the scheduler over random workloads
(arrivals with shared prefixes, aborts, a tiny pool that forces retraction, hybrid full +
sliding + live-tail conv groups, `debug_checks=True`); test_scheduler_stateful.py runs it in
the synchronous loop, test_plan_ahead.py subclasses it for the overlapped one.
"""

from __future__ import annotations

import zlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler import PLACEHOLDER_TOKEN, Scheduler, SchedulerConfig, group_specs_from_layer_types
from scheduler.page_table_oracle import apply_group_ops

VOCAB = 40  # FakeDevice samples ids in [0, VOCAB)
STOP = 3  # the stop token of the FakeDevice workloads
HYBRID = group_specs_from_layer_types(
    layer_types=["conv", "full_attention", "sliding_attention"],
    sliding_window_tokens=6,
    page_size=4,
    conv_kernel_size=3,
    conv_page_size=2,
)

# Recurrent hybrid (Qwen3.5 / Bamba style): a W = 2 state group beside full attention, with the
# state snapshotted at every page end (tokenspeed_jax's device does that).
STATE_HYBRID = group_specs_from_layer_types(
    layer_types=["linear_attention", "full_attention"], sliding_window_tokens=None, page_size=4
)


class FakeDevice:
    """Numpy stand-in for the jitted step (see module docstring)."""

    def __init__(self, cfg: SchedulerConfig, full_group: int) -> None:
        slots = cfg.num_live_slots
        self.mirrors = [np.zeros((slots, lay.width), np.int32) for lay in cfg.group_layouts()]
        self.g = full_group
        self.block = cfg.group_layouts()[full_group].page_size
        self.kv = np.full((cfg.num_pages, self.block), -7, np.int64)  # token id per cached position
        self.last = np.full(slots, -5, np.int32)  # last sampled token per slot

    def run(self, ops) -> np.ndarray:
        for mirror, gops in zip(self.mirrors, ops.groups):
            apply_group_ops(mirror, ops, gops)
        n, q = ops.num_seqs, ops.num_tokens
        tokens = ops.token_ids[:q].astype(np.int64)
        rows = ops.token_rows[:q]
        flag = ops.token_from_prev[:q]
        assert np.all(flag == (tokens == PLACEHOLDER_TOKEN))
        tokens[flag] = self.last[ops.req_slots[rows[flag]]]
        assert np.all(tokens >= 0), "a placeholder was not resolved"
        mirror = self.mirrors[self.g]
        for t in range(q):
            slot, pos = ops.req_slots[rows[t]], ops.positions[t]
            page = mirror[slot, pos // self.block]
            assert page != 0, "token written to the null page"
            self.kv[page, pos % self.block] = tokens[t]
        out = np.full(ops.req_slots.shape[0], -1, np.int32)
        for i in range(n):
            if not ops.sample_mask[i]:
                continue
            slot, kv_len = ops.req_slots[i], ops.kv_lens[i]
            pages = mirror[slot, : -(-kv_len // self.block)]
            ctx = self.kv[pages].reshape(-1)[:kv_len]
            out[i] = zlib.crc32(ctx.tobytes()) % VOCAB
            self.last[slot] = out[i]
        return out


def small_config(**kw) -> SchedulerConfig:
    """A small debug-checked config (full-history group only unless `groups=HYBRID`)."""
    cfg = dict(
        num_pages=40,
        page_size=4,
        max_batch_requests=5,
        max_scheduled_tokens=16,
        max_context_len=64,
        debug_checks=True,
    )
    cfg.update(kw)
    return SchedulerConfig(**cfg)


def full_group(cfg: SchedulerConfig) -> int:
    """Index of the config's full-history group (the one FakeDevice writes KV through)."""
    return [s.retention for s in cfg.groups].index("full_history")


# ---------------------------------------------------------------- the scheduler state machine
MACHINE_STOP = 7  # the stop token of SchedulerMachine's requests (sampled ids are in [0, 12))


def step_shapes(ops) -> list:
    """The shapes of a StepOps' arrays (they never change for one config)."""
    out = [ops.req_slots.shape, ops.cu_q_lens.shape, ops.token_ids.shape, ops.seeds.shape]
    for g in ops.groups:
        out += [g.new_pages.shape, g.rows.shape, g.hole_slots.shape]
    return out


class SchedulerMachine(RuleBasedStateMachine):
    """Random workloads on one scheduler: on top of the debug checks, StepOps shapes never change,
    each request finishes with its exact token count, and all pages come back at the end."""

    GROUPS = HYBRID
    STATE_SNAPSHOTS = "chunk_end"
    HOST_PAGES = 0  # a host KV tier below the pool (scheduler/host_tier.py)
    NUM_PAGES = 40
    STATE_PAGES: int | None = None  # a pool of their own for the state groups

    def __init__(self) -> None:
        super().__init__()
        self.cfg = SchedulerConfig(
            num_pages=self.NUM_PAGES,
            page_size=4,
            max_batch_requests=4,
            max_scheduled_tokens=12,
            max_context_len=48,
            groups=self.GROUPS,
            debug_checks=True,
            state_snapshots=self.STATE_SNAPSHOTS,
            host_pages=self.HOST_PAGES,
            state_pages=self.STATE_PAGES,
        )
        self.sched = Scheduler(self.cfg)
        self.rng = np.random.default_rng(0)
        self.expect: dict[str, tuple[int, bool]] = {}  # id -> (max_new, stop allowed)
        self.finished: dict[str, object] = {}
        self.shapes = None
        self.n = 0

    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4, 5, 6, 1, 2], [9] * 12, [9] * 13]),
        own=st.lists(st.integers(0, 12), min_size=0, max_size=14),
        max_new=st.integers(1, 16),
        stop=st.booleans(),
    )
    def add(self, prefix, own, max_new, stop):
        prompt = prefix + own
        rid = f"r{self.n:03d}"
        self.n += 1
        before = self.sched.stats()
        if not prompt or len(prompt) + max_new > self.cfg.max_context_len:
            with pytest.raises(ValueError):
                self.sched.add_request(rid, prompt, max_new)
            after = self.sched.stats()
            assert after["num_waiting"] == before["num_waiting"]
            return
        self.sched.add_request(rid, prompt, max_new, stop_token_ids=[MACHINE_STOP] if stop else [])
        self.expect[rid] = (max_new, stop)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(positional=st.booleans())
    def step(self, positional=False):
        ops = self.sched.schedule()
        shapes = step_shapes(ops)
        if self.shapes is None:
            self.shapes = shapes
        assert shapes == self.shapes
        assert ops.num_tokens <= self.cfg.max_scheduled_tokens
        if positional:
            # a token that depends only on the position: requests with equal prompts generate
            # equal pages, so pages completed during decode get adopted (non-tail repoints)
            sampled = ((ops.kv_lens * 5 + 3) % 12).astype(np.int32)
        else:
            sampled = self.rng.integers(0, 12, size=self.cfg.max_batch_requests).astype(np.int32)
        if ops.copies is not None:
            self.check_copies(ops.copies)
        for out in self.sched.update(ops, sampled):
            self.check_finished(out)

    def check_copies(self, c):
        """Copy columns: valid entries in range and distinct, the rest the drop sentinels; a
        loaded page now carries a key in the device index, owned by someone."""
        host, dev = self.cfg.host_pages, self.cfg.num_pages
        for cols, n, bound in (
            ((c.save_pages, c.load_pages), (c.num_saves, c.num_loads), dev),
            ((c.save_slots, c.load_slots), (c.num_saves, c.num_loads), host),
        ):
            for col, k in zip(cols, n):
                valid = col[:k].tolist()
                assert len(set(valid)) == k and all(0 <= p < bound for p in valid)
                assert (col[k:] == bound).all()
        assert 0 not in c.save_pages[: c.num_saves] and 0 not in c.load_pages[: c.num_loads]
        pool = self.sched.pool
        for p in c.load_pages[: c.num_loads].tolist():
            assert pool.key_of(p) is not None and pool.refcount(p) >= 1

    @precondition(lambda self: self.expect)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.expect)))
        self.sched.abort(rid)
        del self.expect[rid]

    def check_finished(self, out):
        max_new, stop = self.expect.pop(out.request_id)
        if out.finish_reason == "stop":
            assert stop and out.token_ids[-1] == MACHINE_STOP and len(out.token_ids) <= max_new
            assert MACHINE_STOP not in out.token_ids[:-1]
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == max_new
            assert not stop or MACHINE_STOP not in out.token_ids

    def teardown(self):
        # drain: everything finishes (nobody starves), and every page comes back
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished() and not self.expect
        stats = self.sched.stats()
        assert stats["free_pages"] == stats["total_pages"] and stats["reserved_pages"] == 0
        if self.STATE_PAGES is not None:
            assert stats["state_free_pages"] == stats["state_total_pages"] == self.STATE_PAGES - 1
            assert stats["state_reserved_pages"] == 0

    @invariant()
    def consistent(self):
        self.sched.check_invariants()
