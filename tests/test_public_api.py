"""The public names of SPEC.md exist with the documented signatures (outside suites call them)."""

from __future__ import annotations

import inspect


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_scheduler_names():
    import scheduler as s

    assert s.NULL_PAGE == 0
    pool = s.BlockPool(4)
    assert pool.num_free == 3 and pool.refcount(1) == 0
    t = s.BlockTable()
    assert t.page_ids() == [] and t.num_blocks == 0 and t.tail_avail == 0 and t.reclaim_floor == 0
    for m in (
        s.FullHistoryManager(4),
        s.SlidingWindowManager(4, 8, live_tail_alignment=0),
        s.StateManager(4),
    ):
        for name in (
            "acquire",
            "blocks_needed_for",
            "blocks_needed_for_sequential",
            "reclaim_expired",
            "blocks_reclaimable_at",
            "free",
        ):
            assert callable(getattr(m, name))
    assert _params(s.SlidingWindowManager.blocks_reclaimable_at)[:4] == [
        "self",
        "table",
        "num_tokens",
        "count_uncached",
    ]
    assert _params(s.PagedCacheGroupSpec)[:8] == [
        "group_id",
        "retention",
        "rows_per_page",
        "entry_stride_tokens",
        "sliding_window_tokens",
        "family",
        "block_size",
        "live_tail_alloc",
    ]
    kw = inspect.signature(s.compute_paged_cache_group_page_counts).parameters
    for name in (
        "max_live_requests",
        "max_scheduled_tokens",
        "max_total_tokens",
        "max_context_len",
        "decode_input_tokens",
        "overlap_schedule_depth",
        "safety_margin",
    ):
        assert kw[name].kind is inspect.Parameter.KEYWORD_ONLY
    coord = s.CacheCoordinator([s.PagedCacheGroupSpec("full", "full_history", 4, 1, None)], pool)
    assert coord.lcm == 4 and len(coord.new_tables()) == 1
    cfg = s.SchedulerConfig(num_pages=8)
    assert (
        cfg.page_size,
        cfg.max_batch_requests,
        cfg.max_scheduled_tokens,
        cfg.max_context_len,
        cfg.enable_prefix_cache,
    ) == (16, 64, 2048, 8192, True)
    sched = s.Scheduler(cfg)
    ops = sched.schedule()
    assert ops.num_reqs == 0 and ops.request_ids == ()
    assert not sched.has_unfinished()
    assert {"free_pages", "total_pages", "num_retractions", "prefix_hit_tokens"} <= set(sched.stats())


def test_runtime_names():
    from pallas_kernels import paged_attention, paged_attention_reference
    from tokenspeed_jax import LLM, SamplingParams
    from tokenspeed_jax.page_table import update_rows

    assert _params(paged_attention)[:7] == [
        "q",
        "k_pages",
        "v_pages",
        "page_table",
        "kv_lens",
        "cu_q_lens",
        "num_seqs",
    ]
    assert callable(paged_attention_reference)
    sig = inspect.signature(update_rows)
    assert list(sig.parameters)[:9] == [
        "table",
        "req_slots",
        "begins",
        "sizes",
        "new_pages",
        "full_refresh",
        "rows",
        "row_lens",
        "honor_full_refresh",
    ]
    sp = SamplingParams()
    assert (
        sp.max_tokens,
        sp.temperature,
        sp.top_p,
        sp.top_k,
        sp.seed,
        sp.stop_token_ids,
        sp.logprobs,
        sp.prompt_logprobs,
    ) == (16, 0.0, 1.0, -1, None, (), False, False)
    llm_kw = inspect.signature(LLM).parameters
    for name in (
        "page_size",
        "num_pages",
        "max_batch_requests",
        "max_scheduled_tokens",
        "max_context_len",
        "enable_prefix_cache",
        "dtype",
        "attention_backend",
        "seed",
        "tensor_parallel_size",
        "data_parallel_size",
    ):
        assert name in llm_kw
    assert llm_kw["model"].default == "tiny-random"
