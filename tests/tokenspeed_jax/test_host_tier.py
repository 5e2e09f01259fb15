"""The host KV tier through the engine (issue 49): the same tokens and logprobs with and without
the tier on tiny-random (full + sliding + conv groups) and tiny-hybrid (Gated DeltaNet state
snapshots), in both loops; a retraction-heavy pool with the tier equals a roomy one; the copy
program itself against numpy with NaN garbage around the copied pages; bad sizes refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scheduler.host_tier import PageCopies, copy_bucket
from tests.tokenspeed_jax.conftest import _max_logprob_diff as max_diff
from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.runtime.host_tier import HostKVPool

SP = SamplingParams(max_tokens=6, logprobs=True, ignore_eos=True)


def _prompts(seed: int = 0, n: int = 4) -> list[list[int]]:
    """Sessions sharing a 24-token system prompt, each revisited once after all others ran."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 200, 24).tolist()
    own = [system + rng.integers(3, 200, int(rng.integers(9, 24))).tolist() for _ in range(n)]
    return own + own[::-1]


def _run(model: str, tier: float, *, num_pages: int, one_by_one: bool = True, **kw):
    # 16-token steps, one kv level: two step shapes to compile (1 and 16 tokens), read back from
    # the session's compile cache (tests/conftest.py) by the next LLM of the same shapes
    llm = LLM(model, page_size=8, num_pages=num_pages, max_batch_requests=2, max_scheduled_tokens=16,
              max_context_len=64, debug_checks=True, kv_offloading_size=tier,
              attention_backend="reference", lazy_compile="sync", **kw)  # fmt: skip
    prompts = _prompts()
    outs = [o for p in prompts for o in llm.generate([p], SP)] if one_by_one else llm.generate(prompts, SP)
    st = llm.stats()
    assert st["free_pages"] == st["total_pages"]  # no page leaks
    return [o.token_ids for o in outs], [o.logprobs for o in outs], st


@pytest.mark.parametrize(("model", "async_scheduling"), [("tiny-random", True), ("tiny-hybrid", False)])
def test_same_outputs_with_and_without_the_tier(model, async_scheduling):
    pages = 28 if model == "tiny-random" else 40
    base = _run(model, 0.0, num_pages=pages, async_scheduling=async_scheduling)
    tier = _run(model, 0.002, num_pages=pages, async_scheduling=async_scheduling)
    assert tier[0] == base[0] and max_diff(tier[1], base[1]) < 1e-4
    st = tier[2]
    assert st["host_hit_tokens"] > 0 and st["host_pages_loaded"] > 0 and st["host_pages_saved"] > 0
    assert st["prefix_hit_tokens"] > base[2]["prefix_hit_tokens"]
    assert st["num_prefill_tokens"] < base[2]["num_prefill_tokens"]  # loaded, not recomputed
    page = st["host_bytes_saved"] // st["host_pages_saved"]
    assert st["host_bytes_loaded"] == st["host_pages_loaded"] * page
    # one copy program per (width, loads or not) at most: a few in all, however many steps
    assert 1 <= st["host_copy_compiles"] <= 4


def test_retraction_with_the_tier_equals_a_roomy_pool():
    """A pool too small for the batch: retracted requests resume from the host tier."""
    roomy = _run("tiny-random", 0.0, num_pages=200, one_by_one=False)
    tight = _run("tiny-random", 0.004, num_pages=20, one_by_one=False)
    assert tight[2]["num_retractions"] > 0 and tight[2]["resume_hit_tokens"] > 0
    assert tight[0] == roomy[0] and max_diff(tight[1], roomy[1]) < 1e-4


def test_sleep_and_wake_with_the_tier():
    llm = LLM("tiny-random", page_size=8, num_pages=28, max_batch_requests=2, max_context_len=64,
              max_scheduled_tokens=16, kv_offloading_size=0.002)  # fmt: skip
    prompts = _prompts(1, 4)
    want = [o.token_ids for p in prompts for o in llm.generate([p], SP)]
    assert llm.stats()["host_cached_pages"] > 0
    llm.sleep(1)
    llm.wake_up()
    assert llm.stats()["host_cached_pages"] == 0  # the host tier's K/V went with the pool
    assert [o.token_ids for p in prompts for o in llm.generate([p], SP)] == want


def test_copy_program_against_numpy():
    """Saves read the pages before loads write them (page 3 is both), padding is dropped, and
    nothing else changes: NaN garbage elsewhere stays where it was."""
    rng = np.random.default_rng(0)
    shape = (6, 4, 2, 3)  # 6 device pages
    k = rng.normal(size=shape).astype(np.float32)
    k[0] = np.nan  # the null page, never copied
    k[5] = np.nan  # an unused page
    caches = ({"k": jnp.asarray(k), "v": jnp.asarray(k * 2)},)
    pool = HostKVPool(caches, num_pages=6, host_pages=3, page_axis=0)
    pool.pools[0][1] = 7.0  # host page 1 holds some page's K ...
    pool.pools[1][1] = 8.0  # ... and V
    cols = ([3, 2] + [6] * 14, [0, 2] + [3] * 14, [1] + [3] * 15, [3] + [6] * 15)  # 16: a copy width
    c = PageCopies(2, 1, *(np.array(x, np.int32) for x in cols))
    out = pool.apply(caches, c)
    pool.flush()
    got_k = np.asarray(out[0]["k"])
    want = k.copy()
    want[3] = 7.0
    np.testing.assert_array_equal(got_k, want)  # NaN where it was (assert_array_equal: NaN == NaN)
    np.testing.assert_array_equal(np.asarray(out[0]["v"])[3], 8.0)
    np.testing.assert_array_equal(pool.pools[0][0], k[3])  # page 3 saved before the load
    np.testing.assert_array_equal(pool.pools[0][2], k[2])
    np.testing.assert_array_equal(pool.pools[1][2], 2 * k[2])
    assert pool.num_compiles == 1
    pool.apply(out, c)
    assert pool.num_compiles == 1  # the same width and kind: no new program
    assert pool.warmup() == 5 and pool.warmup() == 0  # 2 widths x 3 kinds in all
    assert jax.tree.structure(out) == jax.tree.structure(caches)


@pytest.mark.parametrize("size", [-1.0, float("nan"), True, "4"])
def test_bad_sizes(size):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM("tiny-random", num_pages=16, kv_offloading_size=size)


def test_a_size_too_small_for_one_page():
    with pytest.raises(ValueError, match="holds no page"):
        LLM("tiny-random", num_pages=16, kv_offloading_size=1e-9, compile_cache_dir=False)


def test_copies_wider_than_one_program_run_in_chunks():
    """130 saves and 130 loads (columns padded to 256): every save chunk reads before any load
    chunk writes, though the loads fill pages the saves read."""
    p, h, n = 140, 140, 130
    k = np.arange(p * 2, dtype=np.float32).reshape(p, 2)
    caches = ({"k": jnp.asarray(k)},)
    pool = HostKVPool(caches, num_pages=p, host_pages=h, page_axis=0)
    pool.pools[0][:] = -np.arange(h * 2, dtype=np.float32).reshape(h, 2)
    saves, slots = np.arange(1, n + 1), np.arange(n)  # device pages 1..130 -> host 0..129
    loads = np.arange(h - 1, h - 1 - n, -1)  # host 139..10 -> device pages 1..130
    width = copy_bucket(n)
    assert width == 256

    def col(x, pad):
        return np.concatenate([x, np.full(width - n, pad)]).astype(np.int32)

    c = PageCopies(n, n, col(saves, p), col(slots, h), col(loads, h), col(saves, p))
    out = np.asarray(pool.apply(caches, c)[0]["k"])
    pool.flush()
    want_host = -np.arange(h * 2, dtype=np.float32).reshape(h, 2)
    np.testing.assert_array_equal(out[1 : n + 1], want_host[loads])  # loaded
    np.testing.assert_array_equal(out[n + 1 :], k[n + 1 :])  # untouched
    np.testing.assert_array_equal(pool.pools[0][:n], k[1 : n + 1])  # saved before the loads wrote
