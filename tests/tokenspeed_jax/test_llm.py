"""LLM end to end on CPU with the real scheduler and the built-in model.

- greedy tokens of a batched, chunked, prefix-sharing run under a pool small enough to force
  retraction == the same requests run alone with a large pool;
- teacher-forcing consistency: the logprobs of generated tokens == the prompt logprobs of the
  same tokens fed back as a prompt;
- seeded sampling reproduces whatever else is in the batch;
- bad input raises ValueError, changes nothing, and the engine keeps serving without leaks.
"""

from __future__ import annotations

import numpy as np
import pytest

from tokenspeed_jax import LLM, SamplingParams

SMALL = dict(page_size=4, max_batch_requests=6, max_scheduled_tokens=32, max_context_len=96)


@pytest.fixture(scope="module")
def big():
    return LLM("tiny-random", num_pages=400, debug_checks=True, **SMALL)


@pytest.fixture(scope="module")
def tight():
    # 3 groups share 40 pages: 6 requests of ~60 tokens cannot all be resident
    return LLM("tiny-random", num_pages=40, debug_checks=True, **SMALL)


def _prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 20).tolist()
    return [system + rng.integers(0, 256, int(rng.integers(3, 14))).tolist() for _ in range(n)]


def test_batched_tight_pool_matches_solo_runs(big, tight):
    prompts = _prompts()
    sp = SamplingParams(max_tokens=24, logprobs=True, ignore_eos=True)
    solo = [big.generate([p], sp)[0] for p in prompts]
    before = tight.stats()["num_retractions"]
    batched = tight.generate(prompts, sp)
    stats = tight.stats()
    assert stats["num_retractions"] > before, "the pool was meant to force retraction"
    assert stats["prefix_hit_tokens"] > 0
    for s, b in zip(solo, batched):
        assert b.token_ids == s.token_ids
        np.testing.assert_allclose(b.logprobs, s.logprobs, atol=1e-4)
    assert stats["free_pages"] == stats["total_pages"]  # nothing leaked


@pytest.mark.parametrize("bucket, ladder", [(1, (1, 2, 4, 8, 16, 32)), (None, (1, 16, 32))])
def test_a_lone_decode_runs_on_one_row_same_tokens(bucket, ladder):
    # None (the default) on CPU: 16, 32 plus a 1-token bucket for a lone decode
    llm = LLM("tiny-random", num_pages=400, min_token_bucket=bucket, **SMALL)
    sixteen = LLM("tiny-random", num_pages=400, min_token_bucket=16, **SMALL)
    assert llm.engine.runner.buckets == ladder
    assert sixteen.engine.runner.buckets == (16, 32)
    prompts = _prompts(3, seed=5)
    sp = SamplingParams(max_tokens=12, logprobs=True, ignore_eos=True)
    for p in prompts:  # one at a time: decodes in bucket 1, the chunk of the prompt in 32
        a, b = llm.generate([p], sp)[0], sixteen.generate([p], sp)[0]
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    both = llm.generate(prompts, sp)  # three decodes a step: bucket 4 (1) or 16 (None)
    assert [o.token_ids for o in both] == [sixteen.generate([p], sp)[0].token_ids for p in prompts]
    llm.engine.runner.programs.wait_background()
    assert 1 in {s.bucket for s in llm.engine.runner.programs.ready}
    with pytest.raises(ValueError, match="min_token_bucket"):
        LLM("tiny-random", num_pages=64, min_token_bucket=0, **SMALL)


def test_generated_logprobs_match_teacher_forced_prompt_logprobs(big):
    prompt = _prompts(1, seed=3)[0]
    out = big.generate([prompt], SamplingParams(max_tokens=12, logprobs=True, ignore_eos=True))[0]
    full = prompt + out.token_ids
    again = big.generate([full], SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    assert again.prompt_logprobs[0] is None and len(again.prompt_logprobs) == len(full)
    np.testing.assert_allclose(again.prompt_logprobs[len(prompt) :], out.logprobs, atol=1e-4)


def test_seed_reproduces_whatever_the_batch(big):
    prompts = _prompts(4, seed=5)
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = big.generate([prompts[0]], sp)[0].token_ids
    crowd = big.generate(
        prompts, [sp] + [SamplingParams(max_tokens=10, temperature=0.7, ignore_eos=True)] * 3
    )
    assert crowd[0].token_ids == alone
    other = big.generate(
        [prompts[0]],
        SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=99, ignore_eos=True),
    )[0]
    assert other.token_ids != alone


def test_string_prompts_and_stop_tokens(big):
    out = big.generate("Hello, paged world!", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.prompt_token_ids[0] == big.tokenizer.bos_token_id and len(out.token_ids) == 8
    assert isinstance(out.text, str)
    stop = out.token_ids[3]
    cut = big.generate(
        "Hello, paged world!", SamplingParams(max_tokens=8, stop_token_ids=(stop,), ignore_eos=True)
    )[0]
    first = out.token_ids.index(stop)
    assert cut.finish_reason == "stop" and cut.token_ids == out.token_ids[: first + 1]


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(), "empty prompt"),
        ([1, 2, 100000], SamplingParams(), "outside the vocabulary"),
        ([1, -3], SamplingParams(), "outside the vocabulary"),
        ([1] * 90, SamplingParams(max_tokens=10), "max_context_len"),
        ([1, 2], SamplingParams(stop_token_ids=[100000]), "stop token id 100000 outside"),
        ([1, 2], SamplingParams(logit_bias={100000: 1.0}), "logit_bias token id 100000 outside"),
    ],
)
def test_bad_prompts_raise_and_engine_keeps_serving(big, prompt, params, match):
    before = big.stats()
    with pytest.raises(ValueError, match=match):
        big.generate([[5, 6, 7], prompt], params)
    after = big.stats()
    assert after["num_waiting"] == 0 and after["num_running"] == 0
    assert after["free_pages"] == before["free_pages"] == after["total_pages"]
    assert len(big.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=0), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_llm_options():
    with pytest.raises(ValueError, match="unknown model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="attention_backend"):
        LLM("tiny-random", attention_backend="magic")
    with pytest.raises(ValueError, match="unknown LLM options"):
        LLM("tiny-random", bogus=1)
    with pytest.raises(ValueError, match="not both"):
        LLM("tiny-random", num_pages=64, kv_cache_memory_bytes=1 << 20)
    for bad in (0, -5, 1.5e6, True):
        with pytest.raises(ValueError, match="kv_cache_memory_bytes must be a positive int"):
            LLM("tiny-random", kv_cache_memory_bytes=bad)


def test_kv_cache_memory_bytes_sizes_the_pool():
    """vLLM's option: the pool gets the pages that fit the given bytes, null page included."""
    from tokenspeed_jax.runtime.state import bytes_per_page

    llm = LLM("tiny-random", **SMALL, kv_cache_memory_bytes=1 << 20)
    layout = llm.engine.runner.layout
    per = bytes_per_page(llm.engine.runner.config, layout.layer_groups, layout.page_sizes)
    assert llm.engine.scheduler.config.num_pages == (1 << 20) // per > 2
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].token_ids


@pytest.mark.parametrize("honor", [True, False])
def test_seed_aliasing_bug_end_to_end(big, honor):
    """Three identical prompts in one step: the later ones adopt the first one's pages (non-tail
    repoints) and their freed private pages come back as new tails in the tight pool. With the
    full-refresh bit honoured every output equals the solo run; a tail-only mirror aliases
    logical pages onto recycled physical ones and greedy generation silently diverges."""
    prompt = np.random.default_rng(0).integers(0, 256, 13).tolist()
    sp = SamplingParams(max_tokens=30, logprobs=True, ignore_eos=True)
    solo = big.generate([prompt], sp)[0]
    llm = LLM("tiny-random", num_pages=40, honor_full_refresh=honor, **SMALL)
    outs = llm.generate([prompt] * 3, sp)
    assert llm.stats()["adopted_pages"] > 0
    worst = max(float(np.max(np.abs(np.array(o.logprobs) - solo.logprobs))) for o in outs)
    if honor:
        assert all(o.token_ids == solo.token_ids for o in outs) and worst < 1e-4
    else:
        assert worst > 0.1  # corrupted KV: the logprobs (and here the tokens) go wrong


def test_warmup_compiles_every_bucket_once_and_changes_nothing():
    llm = LLM("tiny-random", num_pages=64, **SMALL)
    prompt = _prompts(1, seed=8)[0]
    sp = SamplingParams(max_tokens=6, logprobs=True, ignore_eos=True)
    runner = llm.engine.runner
    assert llm.warmup() == len(runner.shape_keys) and llm.warmup() == 0
    out = llm.generate([prompt], sp)[0]
    # serving compiled nothing new (shapes another test stored are read back, not traced)
    assert runner.num_compiles + runner.num_loaded == len(runner.shape_keys)
    cold = LLM("tiny-random", num_pages=64, **SMALL).generate([prompt], sp)[0]
    assert out.token_ids == cold.token_ids
    np.testing.assert_allclose(out.logprobs, cold.logprobs, atol=1e-6)


def test_stream_shows_what_the_output_reports(big):
    """`Engine.stream`: the generated ids (and logprobs / top-k) of a live request so far, from
    any start on; None once it finished. Overlapped loop, so a step is in flight meanwhile."""
    engine = big.engine
    sp = SamplingParams(max_tokens=9, logprobs=True, top_logprobs=2, ignore_eos=True)
    prompts = _prompts(3, seed=5)
    ref = big.generate(prompts, sp)
    rids = [engine.add_request(p, sp) for p in prompts]
    seen: dict[str, list] = {rid: [[], [], []] for rid in rids}
    finished = {}
    while len(finished) < len(rids):
        finished.update((o.request_id, o) for o in engine.step())
        for rid in rids:
            got = seen[rid]
            state = engine.stream(rid, len(got[0]))
            if state is None:
                assert rid in finished
                continue
            assert state.start == len(got[0]) and state.num_generated == len(got[0]) + len(state.token_ids)
            assert len(state.logprobs) == len(state.top_logprobs) == len(state.token_ids)
            for acc, new in zip(got, (state.token_ids, state.logprobs, state.top_logprobs)):
                acc += new
            whole = engine.stream(rid)
            assert whole is not None and whole.token_ids == got[0] and whole.start == 0
    engine.drain()
    for rid, want in zip(rids, ref):
        out, (ids, lps, tops) = finished[rid], seen[rid]
        assert out.token_ids == want.token_ids
        assert ids == out.token_ids[: len(ids)] and len(ids) >= len(out.token_ids) - 2
        np.testing.assert_allclose(lps, out.logprobs[: len(lps)], atol=1e-6)
        assert tops == out.top_logprobs[: len(tops)]
    assert engine.stream("no-such-request") is None
    assert engine.outstanding_tokens == 0


def test_each_path_validates_once(big, monkeypatch):
    """The engine's checks run once per request and `Scheduler.check_prompt` once on the plain
    path (`add_request` with ids: the scheduler's own guard) and once more on the validate-first
    path (`LLM.generate`: the up-front `Engine.validate`, then the scheduler's guard)."""
    from scheduler import Scheduler
    from tokenspeed_jax.engine.engine import CheckedPrompt, Engine

    calls = {"check_prompt": 0, "engine": 0}
    check_prompt, check_ids = Scheduler.check_prompt, Engine._check_ids

    def counted_prompt(self, *a, **k):
        calls["check_prompt"] += 1
        return check_prompt(self, *a, **k)

    def counted_ids(self, *a, **k):
        calls["engine"] += 1
        return check_ids(self, *a, **k)

    monkeypatch.setattr(Scheduler, "check_prompt", counted_prompt)
    monkeypatch.setattr(Engine, "_check_ids", counted_ids)
    sp = SamplingParams(max_tokens=2)
    big.generate(_prompts(3, seed=8), sp)
    assert calls == {"check_prompt": 6, "engine": 3}
    calls.update(check_prompt=0, engine=0)
    engine = big.engine
    rid = engine.add_request([5, 6, 7], sp)
    assert calls == {"check_prompt": 1, "engine": 1}
    checked = engine.validate([5, 6, 8], sp)
    assert isinstance(checked, CheckedPrompt) and checked.ids == [5, 6, 8]
    with pytest.raises(ValueError, match="params it was validated with"):
        engine.add_request(checked, SamplingParams(max_tokens=3))
    calls.update(check_prompt=0, engine=0)
    rid2 = engine.add_request(checked, sp)
    assert calls == {"check_prompt": 1, "engine": 0}
    with pytest.raises(ValueError, match="empty prompt"):  # the scheduler's check, plain path
        engine.add_request([], sp)
    done = set()
    while engine.has_unfinished():
        done.update(o.request_id for o in engine.step())
    engine.drain()
    assert {rid, rid2} <= done


def test_generate_route_is_explicit(big):
    """route="prefix" gives the same outputs on one replica; an unknown policy is refused
    before anything is queued."""
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = _prompts(2, seed=4)
    load = big.generate(prompts, sp)
    assert [o.token_ids for o in big.generate(prompts, sp, route="prefix")] == [o.token_ids for o in load]
    with pytest.raises(ValueError, match="route must be one of"):
        big.generate(prompts, sp, route="random")
    assert not big.engine.has_unfinished()
