"""The built-in Gated DeltaNet hybrid ("tiny-hybrid") through the whole engine against its own
dense forward: page size 4, 16-token chunked prefill (chunks that do not divide the prompts),
prefix-cached recurrent state, and a pool small enough to force retraction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.models.registry import load_builtin

NEW = 12


@pytest.fixture(scope="module")
def dense():
    _, net = load_builtin("tiny-hybrid")
    return net


def _is_greedy(net, prompt: list[int], tokens: list[int]) -> bool:
    """tokens is the dense model's greedy continuation of prompt: each one is the argmax of the
    dense logits given everything before it (one teacher-forced pass instead of len(tokens))."""
    logits = net.dense(jnp.asarray(prompt + tokens[:-1], jnp.int32))[len(prompt) - 1 :]
    return np.asarray(logits.argmax(-1)).tolist() == tokens


def _llm(num_pages: int, **kw) -> LLM:
    return LLM("tiny-hybrid", page_size=4, num_pages=num_pages, max_batch_requests=4, max_scheduled_tokens=16,
               max_context_len=96, attention_backend="reference", debug_checks=True, **kw)  # fmt: skip


def test_prompt_logprobs_match_dense(dense):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (37, 5, 21)]
    outs = _llm(200).generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=True))
    for p, o in zip(prompts, outs, strict=True):
        lp = np.asarray(jax.nn.log_softmax(dense.dense(jnp.asarray(p, jnp.int32)), -1))
        want = lp[np.arange(len(p) - 1), p[1:]]
        assert np.abs(np.asarray(o.prompt_logprobs[1:]) - want).max() < 2e-3


@pytest.mark.parametrize("num_pages, state_pages", [(200, None), (24, None), (40, 12)])
def test_prefix_hits_and_retraction_keep_greedy_tokens(dense, num_pages, state_pages):
    """A shared 24-token prefix: the second batch starts from cached state snapshots (fewer
    tokens computed), every continuation equals the dense greedy one; 24 pages retract. With a
    state pool of its own (12 ids), its snapshots are evicted by one another, not by K/V."""
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 250, 24).tolist()
    prompts = [prefix + rng.integers(3, 250, n).tolist() for n in (3, 6, 9, 13)]
    llm = _llm(num_pages, num_state_pages=state_pages)
    sp = SamplingParams(max_tokens=NEW, logprobs=True, ignore_eos=True)
    first = llm.generate(prompts, sp)
    hits = llm.stats()["prefix_hit_tokens"]
    again = llm.generate(prompts, sp)
    stats = llm.stats()
    assert all(_is_greedy(dense, p, o.token_ids) for p, o in zip(prompts, first, strict=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    np.testing.assert_allclose([o.logprobs for o in again], [o.logprobs for o in first], atol=1e-4)
    # roomy pool: every prompt resumes at its last cached page boundary (>= 20 of 27+ tokens)
    least = 4 * 20 if num_pages == 200 else 1
    assert stats["prefix_hit_tokens"] - hits >= least, "the second batch should resume from the prefix"
    if num_pages == 24:
        assert stats["num_retractions"] > 0
    assert stats["free_pages"] == stats["total_pages"]
    if state_pages:  # the state pool: its own ids, all back, and short enough to evict
        runner = llm.engine.runner
        ssm = [c["ssm"] for c in runner.state.caches if "ssm" in c]
        if runner.scan_layers:  # the CPU default: a run's pools stacked f[n, P, ...]
            assert [s.shape[1] for s in ssm for _ in range(s.shape[0])] == [12] * 3
        else:
            assert [s.shape[0] for s in ssm] == [12] * 3
        assert stats["state_free_pages"] == stats["state_total_pages"] == 11
        assert stats["state_evictions"] > 0


@pytest.mark.parametrize("state_page, resume", [(None, 28), (8, 24)])
def test_state_resumes_at_any_page_boundary(dense, state_page, resume):
    """The recurrent layers snapshot their state at every page end, not only at chunk ends: B
    shares A's first 30 tokens, which no chunk of A ended at (A ran 40 tokens in chunks of 16),
    yet B resumes at 28, the last page boundary inside the shared part, and continues exactly as
    the dense model does and as a run without the prefix cache does. With 8-token state pages
    (`state_page_size`: a snapshot every 8 tokens) the boundary is the last multiple of 8, 24."""
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 250, 30).tolist()
    a, b = shared + rng.integers(3, 250, 10).tolist(), shared + rng.integers(3, 250, 7).tolist()
    sp = SamplingParams(max_tokens=NEW, logprobs=True, ignore_eos=True)
    llm = _llm(200, state_page_size=state_page)
    llm.generate([a], sp)
    before = llm.stats()["prefix_hit_tokens"]
    out = llm.generate([b], sp)[0]
    assert llm.stats()["prefix_hit_tokens"] - before == resume
    assert _is_greedy(dense, b, out.token_ids)
    cold = LLM("tiny-hybrid", page_size=4, num_pages=200, max_batch_requests=4, max_scheduled_tokens=16,
               max_context_len=96, attention_backend="reference", enable_prefix_cache=False)  # fmt: skip
    np.testing.assert_allclose(out.logprobs, cold.generate([b], sp)[0].logprobs, atol=1e-4)


def test_scan_layers_equal_unrolled_with_prefix_hits():
    """scan_layers stacks each run's pools and shifts page ids per layer by the group's page
    size (8 here: neither a state pool's head count 4 nor its conv tail 3); the second batch
    resumes from snapshots the scanned layers wrote."""
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 250, 21).tolist()
    prompts = [shared + rng.integers(3, 250, n).tolist() for n in (3, 9, 17)]
    sp = SamplingParams(max_tokens=8, logprobs=True, ignore_eos=True)
    runs = []
    for scan in (False, True):
        llm = LLM("tiny-hybrid", page_size=8, num_pages=60, max_batch_requests=4, max_scheduled_tokens=16,
                  max_context_len=96, attention_backend="reference", scan_layers=scan)  # fmt: skip
        outs = llm.generate(prompts, sp) + llm.generate(prompts, sp)
        runs.append((outs, llm.stats()["prefix_hit_tokens"]))
    (plain, hits), (scanned, scan_hits) = runs
    assert [o.token_ids for o in scanned] == [o.token_ids for o in plain] and scan_hits == hits > 0
    np.testing.assert_allclose([o.logprobs for o in scanned], [o.logprobs for o in plain], atol=1e-5)
