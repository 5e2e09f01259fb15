"""Speculative rows on the host (issue 24): rejected positions roll back exactly.

`SpecDevice` extends the scheduler tests' `FakeDevice` (tests/scheduler/helpers.py) to verify
drafts: it writes every input of a row (drafts included) into the pages its mirror points at,
then "samples" at each draft position from the context read back through the mirror, accepting
the leading drafts that equal its samples. Its samples mostly follow a fixed token -> token map
(so outputs cycle and n-gram drafts are often right) and otherwise hash the whole context read
through the page table, so a wrong page, a page freed or reused too early, or a rejected position
read back changes the tokens. Random workloads (shared prefixes, stops, aborts, a pool that
forces retraction; full-history and hybrid full + sliding + live-tail conv groups, debug checks
every step) must give the same outputs with speculation as without, and give every page back.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from scheduler import Scheduler, SchedulerConfig, group_specs_from_layer_types
from tests.scheduler.helpers import STOP, VOCAB, FakeDevice, full_group

HYBRID4 = group_specs_from_layer_types(
    layer_types=["conv", "full_attention", "sliding_attention"],
    sliding_window_tokens=6,
    page_size=4,
    conv_kernel_size=3,
    conv_page_size=4,
)


class SpecDevice(FakeDevice):
    @staticmethod
    def sample(ctx: np.ndarray) -> int:
        h = zlib.crc32(ctx.tobytes())
        return int((ctx[-1] * 7 + 3) % VOCAB) if h % 6 else h % VOCAB

    def run_spec(self, ops) -> tuple[np.ndarray, np.ndarray]:
        from scheduler.page_table_oracle import apply_group_ops

        for mirror, gops in zip(self.mirrors, ops.groups):
            apply_group_ops(mirror, ops, gops)
        n, q = ops.num_seqs, ops.num_tokens
        tokens = ops.token_ids[:q].astype(np.int64)
        assert not ops.token_from_prev[:q].any(), "speculation runs the synchronous loop"
        mirror = self.mirrors[self.g]
        for t in range(q):
            slot, pos = ops.req_slots[ops.token_rows[t]], ops.positions[t]
            page = mirror[slot, pos // self.block]
            assert page != 0, "token written to the null page"
            self.kv[page, pos % self.block] = tokens[t]
        out = np.full(ops.req_slots.shape[0], -1, np.int32)
        accepted = np.zeros(ops.req_slots.shape[0], np.int32)
        for i in range(n):
            if not ops.sample_mask[i]:
                continue
            slot, kv_len, d = ops.req_slots[i], ops.kv_lens[i], int(ops.draft_lens[i])
            end = int(ops.cu_q_lens[i + 1])
            for j in range(d + 1):
                length = kv_len - d + j  # context through the input at this position
                pages = mirror[slot, : -(-length // self.block)]
                tok = self.sample(self.kv[pages].reshape(-1)[:length])
                if j < d and tok == tokens[end - d + j]:
                    continue
                out[i], accepted[i] = tok, j
                break
        return out, accepted


def drive(cfg: SchedulerConfig, workload, aborts) -> tuple[dict, Scheduler]:
    sched = Scheduler(cfg)
    dev = SpecDevice(cfg, full_group(cfg))
    outs: dict[str, list[int]] = {}
    step = 0
    pending = sorted(workload, key=lambda w: w[0])
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_new, stop = pending.pop(0)
            sched.add_request(rid, prompt, max_new, stop_token_ids=[STOP] if stop else [])
        for rid in aborts.get(step, ()):
            sched.abort(rid)
        ops = sched.schedule()
        if ops.num_seqs:
            sampled, accepted = dev.run_spec(ops)
            for o in sched.update(ops, sampled, accepted):
                outs[o.request_id] = o.token_ids
        step += 1
        assert step < 2000
    return outs, sched


def _workload(seed: int):
    rng = np.random.default_rng(seed)
    prefixes = [[], [1, 2, 3, 4, 5, 6, 1, 2], [9] * 12]
    work = []
    for i in range(10):
        prompt = list(prefixes[i % 3]) + rng.integers(0, VOCAB, int(rng.integers(1, 10))).tolist()
        work.append(
            (int(rng.integers(0, 12)), f"r{i}", prompt, int(rng.integers(1, 30)), bool(rng.integers(0, 2)))
        )
    aborts = {int(rng.integers(2, 20)): ["r3"], int(rng.integers(2, 20)): ["r7"]}
    return work, aborts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("groups, num_pages, k", [(None, 40, 4), (HYBRID4, 70, 3), (None, 22, 3)])
def test_speculative_rows_match_plain_rows(seed, groups, num_pages, k):
    kw = dict(
        num_pages=num_pages,
        page_size=4,
        max_batch_requests=4,
        max_scheduled_tokens=12,
        max_context_len=64,
        groups=groups,
        debug_checks=True,
        decode_reserve_tokens=0,
    )
    work, aborts = _workload(seed)
    plain, _ = drive(SchedulerConfig(**kw), work, aborts)
    spec_cfg = {"num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    spec, sched = drive(SchedulerConfig(speculative=spec_cfg, **kw), work, aborts)
    for rid in ("r3", "r7"):  # aborted at a fixed step: how far they got differs
        plain.pop(rid, None)
        spec.pop(rid, None)
    assert spec == plain
    s = sched.stats()
    assert s["spec_draft_tokens"] > 0 and s["spec_accepted_tokens"] > 0
    assert s["free_pages"] == s["total_pages"] and s["reserved_pages"] == 0


def test_rollback_frees_pages_only_the_drafts_took():
    """Literal pages: a request at 7 tokens (page size 4: pages [1, 2], 1 free slot) drafts 2
    tokens (positions 7, 8: a third page for position 8); the device rejects both: the third
    page goes back to the pool and the row refreshes."""
    cfg = SchedulerConfig(
        num_pages=10,
        page_size=4,
        max_batch_requests=2,
        max_scheduled_tokens=16,
        max_context_len=32,
        debug_checks=True,
        speculative={"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    )
    sched = Scheduler(cfg)
    sched.add_request("a", [5, 6, 5, 6, 5, 6], 10)
    ops = sched.schedule()  # prefill 6 tokens: pages [1, 2]... sampling 1 token
    sched.update(ops, np.array([5, -1], np.int32))  # tokens now 5 6 5 6 5 6 5
    req = sched.get_request("a")
    assert req.tables[0].pages == [1, 2] and req.num_computed == 6
    # decode of token 5 at position 6 + drafts 6 5 (positions 7, 8): the tokens after the most
    # recent earlier "6 5" (positions 3, 4), which are all it has (k = 3 would allow one more)
    ops = sched.schedule()
    assert ops.draft_lens[0] == 2 and ops.num_tokens == 3
    assert ops.token_ids[:3].tolist() == [5, 6, 5] and ops.positions[:3].tolist() == [6, 7, 8]
    assert req.tables[0].pages == [1, 2, 3]
    sched.update(ops, np.array([9, -1], np.int32), np.array([0, 0], np.int32))  # all rejected
    assert req.tokens[-2:] == [5, 9] and req.num_computed == 7
    assert req.tables[0].pages == [1, 2] and req.tables[0].tail_avail == 1
    assert req.needs_refresh and 3 in sched.pool.free_page_ids()
    ops = sched.schedule()  # the next row rewrites the device row whole (drops column 2)
    assert ops.full_refresh[0]
