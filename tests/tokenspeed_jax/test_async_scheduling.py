"""Overlapped scheduling (`async_scheduling=True`) == the synchronous loop, end to end on CPU.

Two engines with the same model and config, one per loop, with `debug_checks=True` (every step:
the scheduler's mirror twin == its authoritative rows, and the device page tables == the twin),
a pool small enough to force retraction, chunked prefill, shared prefixes (prefix hits +
adoption), mixed max_tokens and stop tokens. Greedy tokens, logprobs and finish reasons must be
identical, no extra token may reach an output, no page may leak, seeded sampling reproduces,
aborts with a step in flight are exact, and warm-up still compiles each token bucket once.
"""

from __future__ import annotations

import numpy as np
import pytest

from tokenspeed_jax import LLM, SamplingParams

CFG = dict(
    page_size=4,
    max_batch_requests=6,
    max_scheduled_tokens=32,
    max_context_len=96,
    max_prefill_chunk_tokens=12,
    debug_checks=True,
)


def _pair(num_pages: int) -> dict[bool, LLM]:
    return {a: LLM("tiny-random", num_pages=num_pages, async_scheduling=a, **CFG) for a in (False, True)}


@pytest.fixture(scope="module")
def tight():
    return _pair(40)  # 3 groups share 40 pages: retraction


@pytest.fixture(scope="module")
def roomy():
    return _pair(400)


def _prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 20).tolist()
    return [system + rng.integers(0, 256, int(rng.integers(3, 14))).tolist() for _ in range(n)]


def _same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        if x.logprobs is not None:
            np.testing.assert_allclose(y.logprobs, x.logprobs, atol=1e-5)
            assert len(y.logprobs) == len(y.token_ids)


def _no_leak(llm: LLM):
    st = llm.stats()
    assert st["free_pages"] == st["total_pages"] and st["reserved_pages"] == 0


@pytest.mark.parametrize("which", ["tight", "roomy"])
def test_greedy_identical_with_retraction_chunks_prefix_hits(which, request):
    pair = request.getfixturevalue(which)
    prompts = _prompts()
    params = [SamplingParams(max_tokens=m, logprobs=True, ignore_eos=True) for m in (1, 2, 24, 17, 30, 9)]
    ref, before = pair[False].generate(prompts, params), pair[True].stats()
    out = pair[True].generate(prompts, params)
    _same(ref, out)
    assert [len(o.token_ids) for o in out] == [p.max_tokens for p in params]
    st = pair[True].stats()
    assert st["prefix_hit_tokens"] > before["prefix_hit_tokens"]
    if which == "tight":
        assert st["num_retractions"] > before["num_retractions"]
    for llm in pair.values():
        _no_leak(llm)
    assert st["async_scheduling"] and st["num_dropped_tokens"] == 0  # length is never planned


def test_stop_tokens_finish_equal_and_the_planned_token_is_dropped(roomy):
    prompts = _prompts(4, seed=2)
    free = roomy[False].generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    # a token each request really generates mid-way becomes its stop token
    params = [
        SamplingParams(max_tokens=20, stop_token_ids=[o.token_ids[3 + i]], logprobs=True, ignore_eos=True)
        for i, o in enumerate(free)
    ]
    ref = roomy[False].generate(prompts, params)
    dropped = roomy[True].stats()["num_dropped_tokens"]
    out = roomy[True].generate(prompts, params)
    _same(ref, out)
    assert all(o.finish_reason == "stop" for o in out)
    assert all(o.token_ids[-1] in p.stop_token_ids for o, p in zip(out, params))
    assert roomy[True].stats()["num_dropped_tokens"] - dropped == len(prompts)
    _no_leak(roomy[True])


def test_seeded_sampling_reproduces(roomy):
    prompts = _prompts(4, seed=5)
    params = [
        SamplingParams(
            max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=1234 + i, ignore_eos=True, logprobs=True
        )
        for i in range(4)
    ]
    ref = roomy[False].generate(prompts, params)
    _same(ref, roomy[True].generate(prompts, params))
    alone = roomy[True].generate([prompts[1]], params[1])[0]
    assert alone.token_ids == ref[1].token_ids


def test_prompt_logprobs_identical(roomy):
    prompts = _prompts(3, seed=7)
    sp = SamplingParams(max_tokens=4, prompt_logprobs=True, logprobs=True, ignore_eos=True)
    ref, out = roomy[False].generate(prompts, sp), roomy[True].generate(prompts, sp)
    _same(ref, out)
    for x, y in zip(ref, out):
        assert x.prompt_logprobs[0] is None and y.prompt_logprobs[0] is None
        np.testing.assert_allclose(y.prompt_logprobs[1:], x.prompt_logprobs[1:], atol=1e-5)


@pytest.mark.parametrize("abort_after", [1, 3, 7])
def test_abort_with_a_step_in_flight(roomy, abort_after):
    engine = roomy[True].engine
    prompts = _prompts(4, seed=9)
    sp = SamplingParams(max_tokens=12, logprobs=True, ignore_eos=True)
    ref = roomy[False].generate(prompts, sp)
    ids = [engine.add_request(p, sp) for p in prompts]
    outs = {}
    for _ in range(abort_after):
        outs.update((o.request_id, o) for o in engine.step())
    assert engine._inflight is not None  # a step is in flight while we abort
    aborted = engine.abort(ids[2])
    assert aborted.finish_reason == "abort"
    assert aborted.token_ids == ref[2].token_ids[: len(aborted.token_ids)]
    assert len(aborted.logprobs) == len(aborted.token_ids)
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    for i in (0, 1, 3):
        assert outs[ids[i]].token_ids == ref[i].token_ids
    assert ids[2] not in outs
    _no_leak(roomy[True])


def test_one_compile_per_bucket():
    llm = LLM("tiny-random", num_pages=200, async_scheduling=True, **CFG)
    runner = llm.engine.runner
    assert llm.warmup() == len(runner.shape_keys)
    before = runner.num_compiles
    llm.generate(_prompts(6, seed=11), SamplingParams(max_tokens=8, ignore_eos=True))
    assert runner.num_compiles == before


def test_overlap_stats_are_reported(roomy):
    st = roomy[True].stats()
    for key in (
        "host_ms_per_step",
        "wait_ms_per_step",
        "critical_ms_per_step",
        "decode_critical_ms_per_step",
        "gapless_dispatch_fraction",
    ):
        assert st[key] >= 0.0, key
    assert st["async_scheduling"] is True and roomy[False].stats()["async_scheduling"] is False
    # default: on (CPU too: benchmarks/overlap.py measures it at least as fast there)
    assert LLM("tiny-random", num_pages=50, **CFG).engine.async_scheduling is True


def test_server_with_async_scheduling():
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from tokenspeed_jax.server.app import build_app

    llm = LLM(
        "tiny-random",
        num_pages=200,
        page_size=8,
        max_batch_requests=4,
        max_scheduled_tokens=32,
        max_context_len=128,
        async_scheduling=True,
    )
    offline = llm.generate("The cache", SamplingParams(max_tokens=6, ignore_eos=True))[0]
    body = {"prompt": "The cache", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(llm)) as client:
        for _ in range(2):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == offline.token_ids
