"""Group specs from layer types and the sizing formulas of DESIGN.md §8."""

from __future__ import annotations

import pytest

from scheduler import (
    PagedCacheGroupSpec,
    compute_max_logical_pages_for_capture,
    compute_paged_cache_group_page_counts,
    group_specs_from_layer_types,
    layer_group_indices,
)

KW = dict(max_live_requests=32, max_scheduled_tokens=8192, max_total_tokens=1_000_000, max_context_len=131072)


def test_design_sizing_example():
    full = PagedCacheGroupSpec("full", "full_history", 256, 1, None)
    swa = PagedCacheGroupSpec("swa", "sliding_window", 128, 1, 511)
    conv = PagedCacheGroupSpec("conv", "sliding_window", 8, 1, 12, live_tail_alloc=True)
    counts = compute_paged_cache_group_page_counts([full, swa, conv], **KW)
    assert counts == {"full": 3940, "swa": 225, "conv": 1121}
    assert compute_max_logical_pages_for_capture(full, max_context_len=131072) == 513
    assert compute_max_logical_pages_for_capture(swa, max_context_len=131072) == 5


def test_state_and_overlap_and_margin():
    state = PagedCacheGroupSpec("state", "sliding_window", 256, 1, 2, family="state")
    # min(2*32 + 1e6//256, ceil(1e6/256) + 32) + 1 = min(3970, 3939) + 1
    assert compute_paged_cache_group_page_counts([state], **KW) == {"state": 3940}
    full = PagedCacheGroupSpec("full", "full_history", 256, 1, None)
    # protected = R * ceil(o*d/P) = 32 * 1
    got = compute_paged_cache_group_page_counts([full], **KW, overlap_schedule_depth=1, safety_margin=5)
    assert got == {"full": 3940 + 32 + 5}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(overlap_schedule_depth=2), "overlap_schedule_depth"),
        (dict(max_live_requests=-1), "max_live_requests"),
    ],
)
def test_sizing_rejects_bad_counts(kwargs, match):
    full = PagedCacheGroupSpec("full", "full_history", 16, 1, None)
    with pytest.raises(ValueError, match=match):
        compute_paged_cache_group_page_counts([full], **{**KW, **kwargs})


def test_spec_validation_names_the_group():
    with pytest.raises(ValueError, match="'swa'.*sliding_window_tokens"):
        PagedCacheGroupSpec("swa", "sliding_window", 16, 1, None)
    with pytest.raises(ValueError, match="'full'.*live_tail_alloc"):
        PagedCacheGroupSpec("full", "full_history", 16, 1, None, live_tail_alloc=True)
    with pytest.raises(ValueError, match="'x'.*retention"):
        PagedCacheGroupSpec("x", "forever", 16, 1, None)


def test_specs_from_layer_types():
    specs = group_specs_from_layer_types(
        layer_types=["conv", "full_attention", "conv", "sliding_attention", "linear_attention"],
        sliding_window_tokens=64,
        page_size=16,
        conv_kernel_size=3,
    )
    assert [s.group_id for s in specs] == ["conv", "full", "sliding", "state"]
    conv, full, swa, state = specs
    assert conv.live_tail_alloc and conv.sliding_window_tokens == 3 and conv.page_size == 8
    assert full.retention == "full_history" and full.page_size == 16
    assert swa.sliding_window_tokens == 64
    assert state.family == "state" and state.sliding_window_tokens == 2
    assert layer_group_indices(["conv", "full_attention", "sliding_attention"], specs) == [0, 1, 2]
    with pytest.raises(ValueError, match="layer 1.*'rwkv'"):
        group_specs_from_layer_types(
            layer_types=["full_attention", "rwkv"], sliding_window_tokens=None, page_size=16
        )
    with pytest.raises(ValueError, match="layer 0.*sliding_window_tokens"):
        group_specs_from_layer_types(
            layer_types=["sliding_attention"], sliding_window_tokens=None, page_size=16
        )
