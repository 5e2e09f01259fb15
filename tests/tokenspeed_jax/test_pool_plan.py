"""The page pool sized on an accelerator (issue 46): `gpu_memory_utilization` of the device, less
the bytes in use, the largest step's temporaries (XLA's memory_analysis, measured on a 2-page
profile runner) and the fixed per-slot state. A CPU has no allocator statistics, so the test
gives the engine a fake accelerator's."""

from __future__ import annotations

import pytest

from tokenspeed_jax import LLM
from tokenspeed_jax.engine import pool_plan
from tokenspeed_jax.runtime import state
from tokenspeed_jax.runtime.device_memory import DeviceMemory

MiB = 1 << 20


@pytest.fixture
def fake_accelerator(monkeypatch):
    memory = DeviceMemory(limit=48 * MiB, in_use=2 * MiB, total=64 * MiB)
    monkeypatch.setattr(pool_plan, "device_memory", lambda device: memory)
    monkeypatch.setattr(state, "device_memory", lambda device: memory)
    return memory


@pytest.mark.parametrize("utilization", [0.5, 0.9])
def test_the_pool_gets_what_the_utilization_leaves(fake_accelerator, utilization):
    kw = dict(max_context_len=256, max_batch_requests=8, max_scheduled_tokens=64, compile_cache_dir=False)
    llm = LLM("tiny-random", gpu_memory_utilization=utilization, **kw)
    temps = llm.step_temp_bytes
    assert temps > 0  # the largest step (64 tokens) has temporaries; measured, not guessed
    layout = llm.engine.runner.layout
    per_page = state.bytes_per_page(llm.engine.runner.config, layout.layer_groups, layout.page_sizes)
    reserved = state.fixed_state_bytes(llm.engine.runner.config, layout.widths, layout.max_live_requests)
    share = min(int(utilization * 64 * MiB), 48 * MiB)  # 0.9 x 64 MiB is above the 48 MiB cap
    want = (share - 2 * MiB - temps - reserved) // per_page
    assert layout.num_pages == want and llm.stats()["total_pages"] == want - 1  # less the null page
    assert llm.generate([[1, 2, 3]])[0].finish_reason == "length"  # it serves on that pool


def test_given_sizes_skip_the_measurement(fake_accelerator):
    llm = LLM("tiny-random", num_pages=40, max_context_len=256, compile_cache_dir=False)
    assert llm.step_temp_bytes == 0 and llm.engine.runner.layout.num_pages == 40
    llm = LLM("tiny-random", kv_cache_memory_bytes=4 * MiB, max_context_len=256, compile_cache_dir=False)
    assert llm.step_temp_bytes == 0


def test_a_hybrid_models_state_snapshots_get_a_pool_of_their_own():
    """Sized from a budget, tiny-hybrid's state snapshots get `state_pool_share` of it (at least
    `min_state_pages`) in a pool of their own and the K/V pages the rest; one shared pool stays
    with a share of 0, a host tier or a given num_pages; num_state_pages is checked."""
    kw = dict(max_context_len=96, max_batch_requests=4, max_scheduled_tokens=16, page_size=4)
    budget = 4 * MiB
    llm = LLM("tiny-hybrid", kv_cache_memory_bytes=budget, **kw)
    layout, config = llm.engine.runner.layout, llm.engine.runner.config
    history, snapshot = state.page_bytes_by_pool(config, layout.layer_groups, layout.page_sizes)
    assert pool_plan.min_state_pages(layout) == 2 * 4 + 16 // 4 + 2
    want_state = max(14, budget // 2 // snapshot)
    assert layout.state_pages == want_state and want_state > 14
    assert layout.num_pages == (budget - want_state * snapshot) // history
    shared = budget // (history + snapshot)
    assert layout.num_pages > 5 * shared  # what one shared pool would hold (more than 5x the K/V)
    assert llm.generate([[5, 6, 7]])[0].finish_reason == "length"
    for one_pool in (dict(state_pool_share=0.0), dict(kv_offloading_size=0.01)):
        layout = LLM("tiny-hybrid", kv_cache_memory_bytes=budget, **kw, **one_pool).engine.runner.layout
        assert layout.state_pages is None and layout.num_pages == shared
    given = LLM("tiny-hybrid", kv_cache_memory_bytes=budget, num_state_pages=20, **kw).engine.runner.layout
    assert given.state_pages == 20 and given.num_pages == (budget - 20 * snapshot) // history
    with pytest.raises(ValueError, match="leave no page"):
        LLM("tiny-hybrid", kv_cache_memory_bytes=budget, num_state_pages=budget // snapshot + 1, **kw)
    with pytest.raises(ValueError, match="needs a recurrent-state group"):
        LLM("tiny-random", num_pages=40, num_state_pages=20, **kw)
    with pytest.raises(ValueError, match="state_pool_share must be a share in"):
        LLM("tiny-hybrid", state_pool_share=1.0, **kw)
