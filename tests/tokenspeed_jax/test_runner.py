"""ModelRunner end to end on CPU, driven by a tiny host scheduler written for this test.

Checks: greedy tokens, logprobs and prompt logprobs == the dense forward; one compile per token
bucket over prefill-only, decode-only, mixed, empty and full steps; the seed's aliasing bug
(adoption repoints page 0, the freed page returns as the tail) corrupts logits only with
`honor_full_refresh=False`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scheduler import GroupStepOps, SchedulerConfig, StepOps, cache_layout
from scheduler.step_ops import sampling_padding
from tokenspeed_jax.models import build_model, tiny_random_config
from tokenspeed_jax.runtime.prepare import prepare
from tokenspeed_jax.runtime.runner import ModelRunner

PAGE, CONV_PAGE, WINDOW, NUM_PAGES, SLOTS, CTX = 4, 2, 6, 64, 4, 32


class Req:
    def __init__(self, rid, prompt, max_new, slot, ngroups):
        self.rid, self.prompt, self.max_new, self.slot = rid, list(prompt), max_new, slot
        self.tokens = list(prompt)
        self.done = 0  # tokens computed
        self.rows = [[] for _ in range(ngroups)]
        self.sent = [0] * ngroups  # columns the device mirror was sent
        self.decoded = False  # previous step was a decode step of this request
        self.logprobs, self.prompt_lp = [], {}


class MiniScheduler:
    """FCFS, decodes first, chunked prefill; full refresh per DESIGN §6; live-tail conv rows."""

    def __init__(self, layout, chunk):
        config = layout.scheduler_config
        self.kinds = [
            ("full" if s.retention == "full_history" else "conv" if s.live_tail_alloc else "sw",
             s.page_size, s.sliding_window_tokens)
            for s in config.groups
        ]  # fmt: skip
        self.layouts = layout.groups
        self.align = math.lcm(*(b for _, b, _ in self.kinds))
        self.r, self.t, self.chunk = config.max_batch_requests, config.max_scheduled_tokens, chunk
        self.free = list(range(1, NUM_PAGES))
        self.reqs: list[Req] = []
        self.free_slots = list(range(SLOTS))

    def add(self, rid, prompt, max_new):
        req = Req(rid, prompt, max_new, self.free_slots.pop(0), len(self.kinds))
        self.reqs.append(req)
        return req

    def _grow(self, req, start, end):
        holes = []
        for g, (kind, b, w) in enumerate(self.kinds):
            row = req.rows[g]
            if kind != "full":
                for s in range(max(0, (start - w + 1) // b)):
                    if row[s]:
                        self.free.insert(0, row[s])
                        row[s] = 0
                        holes.append((g, s))
            while len(row) * b < end:
                s = len(row)
                per = self.align // b
                real = kind != "conv" or s >= (end - w + 1) // b or (s % per >= per - math.ceil((w - 1) / b))
                row.append(self.free.pop(0) if real else 0)
        return holes

    def schedule(self, budget=None) -> StepOps:
        budget = self.t if budget is None else budget
        rows = []
        for req in sorted(self.reqs, key=lambda q: q.done < len(q.prompt)):  # decodes first
            n = 1 if req.done >= len(req.prompt) else min(len(req.prompt) - req.done, self.chunk)
            n = min(n, budget)
            if n == 0 or len(rows) == self.r:
                continue
            budget -= n
            rows.append((req, n))
        r, t = self.r, self.t
        f = lambda shape, v, dt: np.full(shape, v, dt)
        a = dict(req_slots=f(r, -1, np.int32), full_refresh=f(r, False, bool),
                 cu_q_lens=f(r + 1, 0, np.int32), kv_lens=f(r, 0, np.int32),
                 sample_mask=f(r, False, bool), token_ids=f(t, 0, np.int32),
                 token_from_prev=f(t, False, bool), positions=f(t, 0, np.int32), token_rows=f(t, r, np.int32),
                 prompt_targets=f(t, -1, np.int32), temperature=f(r, 0, np.float32),
                 top_p=f(r, 1, np.float32), top_k=f(r, -1, np.int32), seeds=f(r, 0, np.uint32),
                 sample_index=f(r, 0, np.int32), **sampling_padding(r))  # fmt: skip
        groups = [
            dict(begins=f(r, 0, np.int32), sizes=f(r, 0, np.int32),
                 new_pages=f((r, lay.delta_width), 0, np.int32),
                 rows=f((r, lay.width), 0, np.int32), row_lens=f(r, 0, np.int32),
                 hole_slots=f((r, lay.delta_width), lay.width, np.int32))
            for lay in self.layouts
        ]  # fmt: skip
        q = 0
        for i, (req, n) in enumerate(rows):
            start, end = req.done, req.done + n
            refresh = not req.decoded
            holes = self._grow(req, start, end)
            a["req_slots"][i], a["full_refresh"][i], a["kv_lens"][i] = req.slot, refresh, end
            a["sample_mask"][i] = end >= len(req.prompt)
            a["sample_index"][i] = len(req.tokens) - len(req.prompt)
            a["token_ids"][q : q + n] = req.tokens[start:end]
            a["positions"][q : q + n] = np.arange(start, end)
            a["token_rows"][q : q + n] = i
            for j, p in enumerate(range(start, end)):
                if p + 1 < len(req.prompt):
                    a["prompt_targets"][q + j] = req.prompt[p + 1]
            q += n
            a["cu_q_lens"][i + 1 :] = q
            for g, row in enumerate(req.rows):
                d = groups[g]
                if refresh:
                    d["rows"][i, : len(row)], d["row_lens"][i] = row, len(row)
                else:
                    d["begins"][i], d["sizes"][i] = req.sent[g], len(row) - req.sent[g]
                    d["new_pages"][i, : len(row) - req.sent[g]] = row[req.sent[g] :]
                    hs = [s for gg, s in holes if gg == g]
                    d["hole_slots"][i, : len(hs)] = hs
                req.sent[g] = len(row)
        self.rows_of_step = rows
        return StepOps(
            num_seqs=len(rows), num_tokens=q, request_ids=tuple(x.rid for x, _ in rows),
            groups=tuple(GroupStepOps(**d) for d in groups), **a,
        )  # fmt: skip

    def update(self, ops, res):
        for i, (req, n) in enumerate(self.rows_of_step):
            for j in range(n):
                if ops.prompt_targets[ops.cu_q_lens[i] + j] >= 0:
                    req.prompt_lp[req.done + j + 1] = float(res.prompt_logprobs[ops.cu_q_lens[i] + j])
            req.decoded = req.done >= len(req.prompt)
            req.done += n
            if ops.sample_mask[i]:
                req.tokens.append(int(res.sampled[i]))
                req.logprobs.append(float(res.logprobs[i]))
        for req in [x for x in self.reqs if len(x.tokens) - len(x.prompt) >= x.max_new]:
            for row in req.rows:
                self.free = [p for p in reversed(row) if p] + self.free
            self.reqs.remove(req)
            self.free_slots.append(req.slot)


@pytest.fixture(scope="module")
def model_setup():
    cfg = tiny_random_config(sliding_window=WINDOW)
    model = build_model(cfg, seed=3)
    return cfg, model, jax.jit(model.dense)


def make_layout(setup, r, t, honor=True):
    config = SchedulerConfig(
        num_pages=NUM_PAGES,
        page_size=PAGE,
        max_batch_requests=r,
        max_scheduled_tokens=t,
        max_context_len=CTX,
        max_live_requests=SLOTS,
    )
    return cache_layout(config, setup[0], conv_page_size=CONV_PAGE, honor_full_refresh=honor)


def make_runner(setup, layout, **kw):
    return ModelRunner(prepare(setup[0], setup[1]), layout, backend="reference", **kw)


def dense_logp(dense, ids):
    padded = np.zeros(CTX, np.int32)
    padded[: len(ids)] = ids  # causal: padding after the sequence changes nothing before it
    return np.asarray(jax.nn.log_softmax(dense(jnp.asarray(padded))))[: len(ids)]


@pytest.mark.parametrize("min_kv", [256, 8])  # one kv level (full width) | levels 8, 16, 32
def test_greedy_matches_dense_and_one_compile_per_bucket(model_setup, min_kv):
    layout = make_layout(model_setup, r=3, t=32)
    sched = MiniScheduler(layout, chunk=9)
    runner = make_runner(model_setup, layout, min_token_bucket=8, min_kv_bucket=min_kv)
    shapes = runner.shapes
    assert runner.buckets == shapes.buckets == (8, 16, 32)
    assert [t for t, _ in shapes.kv_levels] == ([32] if min_kv == 256 else [8, 16, 32])
    keys = set()
    rng = np.random.default_rng(1)
    reqs = [sched.add(f"r{i}", rng.integers(0, 256, n), 6) for i, n in enumerate((11, 7, 13))]
    finished, buckets, kinds = [], set(), set()
    empty = sched.schedule(budget=0)
    assert empty.num_seqs == 0 and runner.step(empty).sampled.tolist() == [-1] * 3
    budgets = iter([12, 32, 5] * 20)  # token budgets: exercise every bucket
    while sched.reqs:
        ops = sched.schedule(next(budgets))
        decode = ops.sample_mask[: ops.num_seqs] & (
            ops.cu_q_lens[1:][: ops.num_seqs] - ops.cu_q_lens[: ops.num_seqs] == 1
        )
        kinds.add("decode" if decode.all() else "prefill" if not decode.any() else "mixed")
        buckets.add(shapes.bucket_for(ops.num_tokens))
        keys.add((shapes.bucket_for(ops.num_tokens), shapes.kv_levels[shapes.kv_level_for(ops)][0]))
        before = list(sched.reqs)
        sched.update(ops, runner.step(ops))
        finished += [q for q in before if q not in sched.reqs]
    assert kinds == {"prefill", "decode", "mixed"}
    # A full step (num_tokens == T) on a fresh request set.
    full = [sched.add(f"f{i}", rng.integers(0, 256, 16), 1) for i in range(2)]
    sched.chunk = 16
    ops = sched.schedule()
    assert ops.num_tokens == 32
    buckets.add(32)
    keys.add((32, shapes.kv_levels[shapes.kv_level_for(ops)][0]))
    sched.update(ops, runner.step(ops))
    assert len(buckets) == 3
    assert runner.num_compiles == len(keys)  # one per (token bucket, kv bucket) met, none after
    if min_kv == 8:
        assert {kv for _, kv in keys} == {16, 32}  # short and long rows both ran

    _, _, dense = model_setup
    for req in reqs + full:
        logp = dense_logp(dense, req.tokens)
        n = len(req.prompt)
        want = logp[n - 1 : len(req.tokens) - 1].argmax(-1)
        assert req.tokens[n:] == want.tolist(), req.rid
        got_lp = logp[np.arange(n - 1, len(req.tokens) - 1), req.tokens[n:]]
        np.testing.assert_allclose(req.logprobs, got_lp, atol=1e-5)
        plp = [req.prompt_lp[j] for j in range(1, n)]
        np.testing.assert_allclose(plp, logp[np.arange(n - 1), req.prompt[1:]], atol=1e-5)
    assert sorted(sched.free) == list(range(1, NUM_PAGES))  # the test scheduler leaked nothing


@pytest.mark.parametrize("honor", [True, False])
def test_adoption_alias_bug(model_setup, honor):
    """A and B share page 0's tokens. A adopts B's page 0, frees its own, which returns as A's
    new tail: authoritative row [CACHED, P1, P0]; a tail-only mirror makes it [P0, P1, P0]."""
    layout = make_layout(model_setup, r=2, t=16, honor=honor)
    sched = MiniScheduler(layout, chunk=16)
    runner = make_runner(model_setup, layout, min_token_bucket=16)
    rng = np.random.default_rng(2)
    shared = list(rng.integers(0, 256, PAGE))
    a = sched.add("A", shared + list(rng.integers(0, 256, 4)), 4)
    b = sched.add("B", shared + list(rng.integers(0, 256, 2)), 4)
    ops = sched.schedule()
    sched.update(ops, runner.step(ops))
    full_g = [k for k, _, _ in sched.kinds].index("full")
    p0, cached = a.rows[full_g][0], b.rows[full_g][0]
    a.rows[full_g][0] = cached  # adopt the canonical page (same tokens -> same K/V)
    sched.free.insert(0, p0)  # the freed duplicate is first in line: A's next page
    while sched.reqs:
        ops = sched.schedule()
        sched.update(ops, runner.step(ops))
    assert a.rows[full_g][:3] == [cached, a.rows[full_g][1], p0]
    dense = model_setup[2]
    logp = dense_logp(dense, a.tokens)
    n = len(a.prompt)
    want = logp[np.arange(n - 1, len(a.tokens) - 1), a.tokens[n:]]
    err = np.abs(np.asarray(a.logprobs) - want).max()
    if honor:
        assert err < 1e-5
    else:
        assert err > 1e-3  # the new tokens overwrote the prefix's K/V: output diverges


def test_clamped_row_warns_naming_the_request(model_setup, caplog):
    """DESIGN §6 rule 3: an update past the mirror width is clamped on the device (no crash) and
    the runner logs a warning naming the request. `add_request` never emits one, so hand-build it."""
    layout = make_layout(model_setup, r=2, t=16)
    sched = MiniScheduler(layout, chunk=4)
    runner = make_runner(model_setup, layout, min_token_bucket=16)
    sched.add("ok", [1, 2, 3], 1)
    sched.add("too-wide", [4, 5, 6], 1)
    ops = sched.schedule()
    grp, width = ops.groups[0], layout.widths[0]
    ops.full_refresh[:2] = False
    grp.begins[:2], grp.sizes[:2] = (0, width - 1), (1, 2)  # row 1 writes columns W-1 and W
    with caplog.at_level("WARNING", logger="tokenspeed_jax.runtime.runner"):
        runner.step(ops)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "too-wide" in warned[0] and layout.groups[0].group_id in warned[0]
    assert f"width {width}" in warned[0]
