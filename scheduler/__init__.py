"""Host-side paged-KV scheduler: pure Python + numpy (never imports jax)."""

from __future__ import annotations

from scheduler.block_pool import NULL_PAGE, BlockPool
from scheduler.block_table import BlockTable
from scheduler.coordinator import CacheCoordinator
from scheduler.full_history import CacheGroupManager, FullHistoryManager
from scheduler.group_spec import (
    PagedCacheGroupSpec,
    compute_max_logical_pages_for_capture,
    compute_paged_cache_group_page_counts,
    group_specs_from_layer_types,
    layer_group_indices,
)
from scheduler.sampling_options import SamplingOptions
from scheduler.sliding_window import SlidingWindowManager, StateManager
from scheduler.step_ops import PLACEHOLDER_TOKEN, GroupLayout, GroupStepOps, StepOps

__all__ = [
    "NULL_PAGE",
    "BlockPool",
    "BlockTable",
    "CacheCoordinator",
    "CacheGroupManager",
    "FullHistoryManager",
    "GroupLayout",
    "GroupStepOps",
    "PLACEHOLDER_TOKEN",
    "PagedCacheGroupSpec",
    "SamplingOptions",
    "SlidingWindowManager",
    "StateManager",
    "StepOps",
    "compute_max_logical_pages_for_capture",
    "compute_paged_cache_group_page_counts",
    "group_specs_from_layer_types",
    "layer_group_indices",
]

from scheduler.cache_layout import CacheLayout, cache_layout  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.request import RequestOutput  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from scheduler.step_update import StepUpdate  # noqa: E402

__all__ += ["CacheLayout", "RequestOutput", "Scheduler", "SchedulerConfig", "StepUpdate", "cache_layout"]
