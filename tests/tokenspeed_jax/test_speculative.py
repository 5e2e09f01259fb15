"""N-gram speculative decoding (issue 24): exact on the paged cache.

Greedy outputs with speculation equal those without, token for token, on tiny-random under
chunked prefill, prefix hits, stop tokens and max_tokens landing inside accepted runs, forced
retraction and aborts, with the debug mirror checks on every step and no page leaked. The random
model rarely repeats itself, so a second variant zeroes every layer's output projections: the
model then maps each token to the next one alone, its greedy outputs cycle, and most drafts are
accepted (the bookkeeping of long accepted runs). The device rule is tested on its own
(`verify_drafts`): greedy acceptance counts, and a chi-square test that speculative sampling
keeps the target distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scheduler import SchedulerConfig
from scheduler.group_spec import PagedCacheGroupSpec
from scheduler.speculative import SpeculativeConfig, StepCosts, choose_drafts, propose_ngram
from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.runtime.device_ops import DeviceOps
from tokenspeed_jax.runtime.spec_verify import verify_drafts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# a pool tight enough that the 4-row batches below retract (decode_reserve_tokens=0)
KW = dict(
    page_size=4,
    num_pages=48,
    max_batch_requests=4,
    max_scheduled_tokens=32,
    max_context_len=256,
    max_prefill_chunk_tokens=12,
    compile_cache_dir=False,
    debug_checks=True,
    decode_reserve_tokens=0,
    lazy_compile="sync",  # only the shapes a run takes compile (same outputs)
)


def _cycling(llm: LLM, on: bool = True) -> LLM:
    """Zero every layer's output projections (attention o_proj, MLP down_proj, conv out_proj):
    each token's logits then depend on that token alone and greedy outputs cycle. on=False puts
    the random weights back."""
    for e in llm.engines:
        r = e.runner
        if not hasattr(r, "_random_leaves"):
            r._random_leaves = list(r.param_leaves)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(r.params)[0]]
        zero = ("o_proj", "down_proj", "out_proj")
        r.param_leaves = [
            x * 0 if on and any(k in p for k in zero) else x for p, x in zip(paths, r._random_leaves)
        ]
    return llm


@pytest.fixture(scope="module")
def engines():
    """(without speculation, with speculation) engines on the same weights."""
    return LLM("tiny-random", **KW), LLM("tiny-random", speculative_config=SPEC, **KW)


@pytest.fixture
def pair(engines):
    """`engines` on the cycling weights."""
    return tuple(_cycling(e) for e in engines)


def _identity(h):
    return h


# jitted once per shape: op-by-op dispatch of the [n, k + 1, V] rule is slow on CPU
_verify = jax.jit(verify_drafts, static_argnums=(2, 3, 4))


def _prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 16).tolist()  # a prefix hit for the later prompts
    motif = [11, 12, 13, 14, 15]
    return [
        shared + motif * 3,
        shared + rng.integers(0, 256, 9).tolist(),
        motif * 4,
        rng.integers(0, 256, 30).tolist(),
        [7, 7, 7, 7],
        shared + [1, 2, 3, 1, 2],
    ]


def _check_equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert y.token_ids == x.token_ids, (x.request_id, x.token_ids, y.token_ids)
        assert y.finish_reason == x.finish_reason


def _no_leak(llm):
    s = llm.engine.stats()
    assert s["free_pages"] == s["total_pages"] and s["num_running"] == s["num_waiting"] == 0


def test_greedy_equal(pair):
    base, spec = pair
    prompts = _prompts()
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 33, 57, 20, 48, 35)]
    _check_equal(base.generate(prompts, params), spec.generate(prompts, params))
    stats = spec.engine.stats()
    assert stats["spec_acceptance_rate"] > 0.3  # cycling weights: long accepted runs
    _no_leak(spec)


def test_greedy_equal_random_weights(engines):
    """Full model weights: the cache contents decide every token (few drafts are accepted)."""
    base, spec = (_cycling(e, on=False) for e in engines)
    prompts = _prompts()[:4]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    before = spec.engine.stats()["spec_draft_tokens"]
    _check_equal(base.generate(prompts, params), spec.generate(prompts, params))
    assert spec.engine.stats()["spec_draft_tokens"] > before
    _no_leak(spec)


def test_stops_and_max_tokens_inside_accepted_runs(pair):
    """Stop ids taken from the reference outputs (so some land inside an accepted run) and short
    max_tokens: nothing past either is returned."""
    base, spec = pair
    prompts = _prompts()
    ref = base.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    params = [
        SamplingParams(max_tokens=40, stop_token_ids=[r.token_ids[9 + i]], ignore_eos=True)
        for i, r in enumerate(ref)
    ]
    params += [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 3, 5, 6, 7, 9)]
    _check_equal(base.generate(prompts * 2, params), spec.generate(prompts * 2, params))
    _no_leak(spec)


def test_retraction_and_abort(pair):
    """The pool is too small for the batch: retraction mid-speculation; an abort between steps
    returns its pages at once; the others finish as without speculation."""
    base, llm = pair
    prompts = _prompts()[:4]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = base.generate(prompts, params)
    before = llm.engine.stats()["num_retractions"]
    _check_equal(ref, llm.generate(prompts, params))
    assert llm.engine.stats()["num_retractions"] > before
    engine = llm.engine
    rids = [engine.add_request(p, params) for p in prompts]
    for _ in range(6):
        engine.step()
    engine.abort(rids[1])
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs[r].token_ids for r in (rids[0], rids[2], rids[3])] == [ref[i].token_ids for i in (0, 2, 3)]
    _no_leak(llm)


def test_sampled_runs_and_ineligible_requests(pair):
    """Seeded temperature / top-p / top-k rows speculate and emit the very tokens they emit
    without speculation (each position draws with the ordinary key: `spec_verify`); rows with
    logprobs or penalties do not speculate and match the engine without speculation exactly."""
    base, spec = pair
    prompts = _prompts()[:3]
    hot = [
        SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.3, top_k=5, seed=6, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.5, seed=7, ignore_eos=True),
    ]
    before = spec.engine.stats()["spec_accepted_tokens"]
    _check_equal(base.generate(prompts, hot), spec.generate(prompts, hot))
    assert spec.engine.stats()["spec_accepted_tokens"] > before
    plain = [
        SamplingParams(max_tokens=25, logprobs=True, ignore_eos=True),
        SamplingParams(max_tokens=25, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=25, top_logprobs=2, logprobs=True, ignore_eos=True),
    ]
    before = spec.engine.stats()["spec_num_rows"]
    a, b = base.generate(prompts, plain), spec.generate(prompts, plain)
    _check_equal(a, b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(y.logprobs or [], x.logprobs or [], atol=1e-5)
    assert spec.engine.stats()["spec_num_rows"] == before
    _no_leak(spec)


# ---------------------------------------------------------------------- the proposer, config
def test_propose_ngram():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], 4, 1, 3) == [3, 1, 2]  # most recent match
    assert propose_ngram([5, 6, 7], 2, 1, 2) == []
    assert propose_ngram([256, 1, 256], 2, 1, 1) == [1, 256]
    assert propose_ngram([1, 0, 0, 0, 2], 2, 1, 1) == []  # byte hits off the int32 grid
    assert propose_ngram([9, 4, 5, 8, 4, 5], 2, 2, 2) == [8, 4]
    assert propose_ngram([9, 4, 5, 8, 4, 5], 2, 3, 3) == []  # n_min: no 3-gram recurs


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "eagle"}, "method"),
        ({"draft_model": "x"}, "unknown keys"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ],
)
def test_bad_config(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match=match):
        LLM("tiny-random", speculative_config=bad, num_pages=8, compile_cache_dir=False)


def test_config_limits():
    state = PagedCacheGroupSpec.make(
        "state", "sliding_window", page_size=4, sliding_window_tokens=2, family="state"
    )
    with pytest.raises(ValueError, match="recurrent-state"):
        SchedulerConfig(num_pages=8, groups=[state], speculative=SPEC)
    with pytest.raises(ValueError, match="recurrent-state"):  # the same through the engine
        LLM("tiny-hybrid", speculative_config=SPEC, num_pages=32, compile_cache_dir=False)
    conv = PagedCacheGroupSpec.make(
        "conv", "sliding_window", page_size=4, sliding_window_tokens=3, live_tail_alloc=True
    )
    SchedulerConfig(num_pages=8, groups=[conv], speculative=dict(SPEC, num_speculative_tokens=4))
    with pytest.raises(ValueError, match="live-tail"):
        SchedulerConfig(num_pages=8, groups=[conv], speculative=dict(SPEC, num_speculative_tokens=5))


# ---------------------------------------------------------------------- the device rule
def _ops(rows_tokens, drafts_per_row, temperature=0.0, seeds=None):
    """Unpacked-StepOps-like arrays of rows whose query tokens are given (hidden = one-hot
    logits rows, see `_verify`)."""
    n = len(rows_tokens)
    cu = np.concatenate([[0], np.cumsum([len(t) for t in rows_tokens])]).astype(np.int32)
    given = {
        "draft_lens": jnp.asarray(drafts_per_row, jnp.int32),
        "cu_q_lens": jnp.asarray(cu),
        "token_ids": jnp.asarray(np.concatenate(rows_tokens), jnp.int32),
        "temperature": jnp.full((n,), temperature, jnp.float32),
        "top_k": jnp.full((n,), -1, jnp.int32),
        "top_p": jnp.ones((n,), jnp.float32),
        "seeds": jnp.asarray(np.arange(n) if seeds is None else seeds, jnp.uint32),
        "sample_index": jnp.zeros((n,), jnp.int32),
    }
    unused = {
        f.name: jnp.zeros((n,), jnp.int32)
        for f in dataclasses.fields(DeviceOps)
        if f.name not in given and f.name != "groups"
    }  # verify_drafts never reads them
    return DeviceOps(**given, **unused, groups=())


def test_verify_greedy_counts():
    v, k = 8, 3
    # row 0: target argmax chain 3, 4, 5, 6 and drafts 3, 4, 7 -> accepts 2, token 5
    # row 1: drafts 1, 2 against targets 2, ...        -> accepts 0, token 2
    # row 2: no drafts                                   -> its ordinary greedy token 6
    # row 3: all 3 drafts right                          -> accepts 3, bonus token 0
    targets = [[3, 4, 5, 6], [2, 2, 2], [6], [5, 6, 7, 0]]
    tokens = [[9, 3, 4, 7], [9, 1, 2], [9], [9, 5, 6, 7]]
    drafts = [3, 2, 0, 3]
    hidden = jnp.asarray(np.concatenate([np.eye(v)[t] for t in targets]), jnp.float32)
    ops = _ops([np.asarray(t) for t in tokens], drafts)
    got, accepted = _verify(hidden, ops, 4, k, _identity)
    assert accepted.tolist() == [2, 0, 0, 3]
    assert got.tolist() == [5, 2, 6, 0]
    # the argmax ids of every token given (`sample_rows` on a small bucket): the same counts
    ids = jnp.argmax(hidden, axis=-1).astype(jnp.int32)
    got, accepted = _verify(hidden, ops, 4, k, _identity, None, ids)
    assert accepted.tolist() == [2, 0, 0, 3] and got.tolist() == [5, 2, 6, 0]


def test_verify_sampling_keeps_the_target_distribution():
    """Row j of 4000 identical rows: position 0 targets p0, position 1 targets p1; the draft is
    token 1 then token 2. The first emitted token must follow p0 and, after an accepted first
    draft, the second must follow p1 (chi-square, fixed seeds; a rule that accepted the draft
    unconditionally would emit token 1 first every time), and draft 1 is accepted with
    probability p0(1)."""
    n, v = 4000, 4
    p0 = np.array([0.1, 0.5, 0.3, 0.1])
    p1 = np.array([0.4, 0.1, 0.2, 0.3])
    logits = np.log(np.stack([p0, p1, p0]))  # the last row: bonus position (unused here)
    hidden = jnp.asarray(np.tile(logits, (n, 1)), jnp.float32)
    rows = [np.array([0, 1, 2])] * n
    ops = _ops(rows, [2] * n, temperature=1.0, seeds=np.arange(n) + 7)
    got, accepted = _verify(hidden, ops, n, 2, _identity)
    got, accepted = np.asarray(got), np.asarray(accepted)
    first = np.where(accepted >= 1, 1, got)
    second = np.where(accepted >= 2, 2, got)[accepted >= 1]
    for seen, p in ((first, p0), (second, p1)):
        counts = np.bincount(seen, minlength=v)
        expected = p * len(seen)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 16.27, (counts, expected)  # chi-square, 3 dof, p = 0.001
    assert abs((accepted >= 1).mean() - p0[1]) < 0.03  # draft 1 accepted with p0(1)


# ---------------------------------------------------------------------- the CLI flag
@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--speculative-config", '{"num_speculative_tokens": 0}'],
        ["serve", "--speculative-config", "not json"],
        ["run", "--speculative-config", '{"method": "medusa"}'],
    ],
)
def test_cli_bad_speculative_config(capsys, argv):
    from tokenspeed_jax import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--speculative-config" in err[0], err


def test_padding_policy_fills_bucket_padding():
    """draft_policy "padding" (the older `padding_only=True`): the padding of the bucket the
    one-token rows occupy, shared evenly, at least one per row while any is left."""
    cfg = SpeculativeConfig.parse({"num_speculative_tokens": 4, "padding_only": True})
    assert cfg.draft_policy == "padding"
    buckets = (16, 32, 64)

    def drafts(rows, max_rows=64, lengths=None):
        lengths = lengths or [4] * min(rows, max_rows)
        return choose_drafts(cfg, [(n, 0) for n in lengths], rows, buckets, max_rows)

    assert drafts(1) == [4]  # batch 1: k drafts, all in padding
    assert drafts(8) == [1] * 8  # 8 rows in bucket 16: one each
    assert drafts(5) == [2] * 5  # 11 padding tokens: 2 each
    assert drafts(16) == [0] * 16  # bucket full: no drafts
    assert drafts(40, max_rows=32) == [0] * 32  # 32 rows at most, bucket 32 full
    assert drafts(3, lengths=[1, 4, 4]) == [1, 4, 4]  # short proposals keep theirs
    assert choose_drafts(cfg, [(4, 0)] * 3, 3, (), 64) == [4] * 3  # buckets unknown: all
    always = SpeculativeConfig.parse({"num_speculative_tokens": 4, "padding_only": False})
    assert always.draft_policy == "always"
    assert choose_drafts(always, [(4, 0)] * 16, 16, buckets, 64) == [4] * 16
    with pytest.raises(ValueError, match="not both"):
        SpeculativeConfig.parse({"padding_only": True, "draft_policy": "cost"})
    with pytest.raises(ValueError, match="draft_policy"):
        SpeculativeConfig.parse({"draft_policy": "sometimes"})


def _bucket_log(llm):
    """Record the token bucket of every dispatched step (the one its shape asks for: a lazily
    compiled shape may run as a covering one meanwhile), with its drafts: [(bucket, drafts,
    decode only)]."""
    runner = llm.engine.runner
    log = []
    dispatch = runner.dispatch

    def logged(ops, *a):
        n = ops.num_seqs
        drafts = int(ops.draft_lens[:n].sum())
        log.append(
            (
                runner.shapes.step_shape(ops).bucket,
                drafts,
                bool(ops.sample_mask[:n].all()) and int(ops.num_tokens) == n + drafts,
            )
        )
        return dispatch(ops, *a)

    runner.dispatch = logged
    return log


def test_lone_decode_bucket_with_speculation():
    """The CPU ladder keeps its 1-token bucket with speculation ("cost", the default): a lone
    decode whose row proposes nothing runs in it, a row whose drafts pay runs in 16, and the
    outputs are those of the engine without speculation; one compile per shape met. "padding"
    keeps the old ladder (no 1-token bucket: every decode of it pays for 16 rows)."""
    kw = dict(KW, max_batch_requests=2)  # lazy_compile="sync": every step in its own shape
    base = LLM("tiny-random", **kw)
    spec = LLM("tiny-random", speculative_config=SPEC, **kw)
    pad = LLM("tiny-random", speculative_config=dict(SPEC, draft_policy="padding"), **kw)
    assert base.engine.runner.buckets == spec.engine.runner.buckets == (1, 16, 32)
    assert pad.engine.runner.buckets == (16, 32)
    prompts = _prompts()
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    # random weights: few proposals, so most lone decodes have none; then the cycling weights,
    # where the proposals are right and drafts pay for the 16 bucket
    log = _bucket_log(spec)
    # the choice from fixed relative costs (16 ~1.9x 1, `StepCosts`'s guess): timed ones follow
    # the machine, and on a loaded CI worker a few slow 16-token steps made drafts never pay
    # (the timing itself is checked below; the choice from timings in test_draft_policy)
    spec.engine.scheduler.step_costs.cost = lambda b: b + StepCosts.HALF
    for cycling in (False, True):
        for e in (base, spec):
            _cycling(e, on=cycling)
        log.clear()
        for p in prompts:  # batch 1
            _check_equal(base.generate([p], params), spec.generate([p], params))
        decodes = [(b, d) for b, d, only in log if only]
        assert all(b == 1 for b, d in decodes if d == 0), decodes
        assert any(b == 1 for b, d in decodes)
        if cycling:
            assert any(b == 16 and d > 0 for b, d in decodes), decodes
    runner = spec.engine.runner
    assert runner.num_compiles + runner.num_loaded <= len(runner.shape_keys)
    assert spec.engine.scheduler.step_costs.measured().keys() >= {1, 16}
    log = _bucket_log(_cycling(pad))
    _check_equal(base.generate(prompts[:2], params), pad.generate(prompts[:2], params))
    assert all(b >= 16 for b, _, _ in log)
