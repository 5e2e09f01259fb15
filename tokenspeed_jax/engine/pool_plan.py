"""How big the page pool is: given (`num_pages`), from given bytes (`kv_cache_memory_bytes`),
or from what the device has left (issue 46).

On an accelerator with nothing given, the pool gets what `gpu_memory_utilization` of the device
leaves after the weights (already placed), the largest step's temporaries and the fixed per-slot
state. The temporaries are measured as vLLM's profile run measures them, without the run: a
runner over a 2-page pool makes its largest step ready (compiled, or read from the executable
cache, where it then stays for the next start) and XLA's `memory_analysis()` reports its
temporary bytes (`ModelRunner.largest_step_temp_bytes`); the pools are donated arguments, so the
temporaries do not depend on the pool size. Multi-process runs skip the measurement (0 bytes)
and take the smallest fit of every process.

A hybrid model's recurrent-state snapshots get a pool of their own (`SchedulerConfig.state_pages`)
when the pools are sized here: `num_state_pages` ids, or `state_pool_share` of the budget (at
least `min_state_pages`), and the shared pool the rest, each id paying only its own layers. One
shared pool stays where the user gave `num_pages`, with a host KV tier, with a share of 0, or
where the state floor would leave the shared pool nothing.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from scheduler import CacheLayout, SchedulerConfig, cache_layout
from tokenspeed_jax.engine_args import EngineArgs, default_context_len
from tokenspeed_jax.runtime.device_memory import device_memory


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """layout: the cache layout with its pool size; step_temp_bytes: the largest step's
    temporaries reserved before the pool was sized (0 when not measured)."""

    layout: CacheLayout
    step_temp_bytes: int = 0


def cache_layout_of(args: EngineArgs, model_config: Any) -> CacheLayout:
    """The layout both sides share, over `num_pages` (2 until `plan_pool` sizes it) and
    `num_state_pages` when given (ValueError for a model without recurrent layers)."""
    max_context_len = args.max_context_len
    if max_context_len is None:
        max_context_len = default_context_len(args.model, model_config)
    sched_cfg = SchedulerConfig(
        num_pages=2 if args.num_pages is None else args.num_pages,
        max_context_len=max_context_len,
        **args.scheduler_options(),
    )
    layout = cache_layout(
        sched_cfg,
        model_config,
        conv_page_size=args.conv_page_size,
        honor_full_refresh=args.honor_full_refresh,
        state_page_size=args.state_page_size,
    )
    if args.num_state_pages is None:
        return layout
    return layout.with_num_pages(layout.num_pages, args.num_state_pages)  # checked on the groups


def plan_pool(
    args: EngineArgs,
    runtime_config: Any,
    layout: CacheLayout,
    mesh: Any,
    multi: bool,
    make_runner: Callable[..., Any],
) -> PoolPlan:
    """`layout` with its pool sized (module docstring). make_runner(layout, mesh=...) builds a
    `ModelRunner` (the profile runner)."""
    if args.num_pages is not None:
        return PoolPlan(layout)
    from tokenspeed_jax.runtime.state import fixed_state_bytes, pages_from_memory, pool_budget

    device = (
        jax.devices()[0]
        if mesh is None
        else next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    )
    temp_bytes = 0
    if args.kv_cache_memory_bytes is None and not multi and device_memory(device) is not None:
        profile = make_runner(layout.with_num_pages(2), mesh=mesh)
        temp_bytes = profile.largest_step_temp_bytes()
        del profile
        gc.collect()  # its buffers (tiny pools, penalties) go back before the real ones
    reserved = fixed_state_bytes(runtime_config, layout.widths, layout.max_live_requests)
    budget, shards = pool_budget(
        device,
        args.gpu_memory_utilization,
        temp_bytes,
        reserved,
        args.kv_cache_memory_bytes,
        args.tensor_parallel_size,
    )
    split = split_pools(args, runtime_config, layout, budget, shards)
    state_pages: int | None = None
    if split is not None:
        num_pages, state_pages = split
    else:  # one shared pool: the same budget over every layer's bytes per page id
        num_pages = pages_from_memory(
            runtime_config,
            layout.layer_groups,
            layout.page_sizes,
            device=device,
            shards=args.tensor_parallel_size,
            kv_cache_dtype=args.kv_cache_dtype,
            budget_bytes=budget,
        )
    if multi:  # every process must build the same shapes: the smallest fit wins
        from jax.experimental import multihost_utils

        sizes = np.array([num_pages, state_pages or 0], np.int32)
        num_pages, state = (int(n) for n in np.min(multihost_utils.process_allgather(sizes), axis=0))
        state_pages = state or None
    return PoolPlan(layout.with_num_pages(num_pages, state_pages), temp_bytes)


def min_state_pages(layout: CacheLayout) -> int:
    """The state pool's floor: two snapshots for every live request (the live state and the one
    before it: W = 2) plus the pages of one full step's chunk and two edges, so the state pool
    does not cap the batch before the shared pool does."""
    cfg = layout.scheduler_config
    page = min(s.page_size for s in cfg.group_specs if s.family == "state")
    return 2 * cfg.num_live_slots + -(-cfg.max_scheduled_tokens // page) + 2


def split_pools(
    args: EngineArgs, runtime_config: Any, layout: CacheLayout, budget: int, shards: int
) -> tuple[int, int] | None:
    """(num_pages, state_pages) of `budget` bytes per device split between the shared pool and
    a state pool of its own (module docstring), or None for one shared pool."""
    from tokenspeed_jax.runtime.state import page_bytes_by_pool, split_pool_pages

    history, state = page_bytes_by_pool(
        runtime_config, layout.layer_groups, layout.page_sizes, args.kv_cache_dtype
    )
    if not state or not history or args.kv_offloading_size:
        return None
    history, state = -(-history // shards), -(-state // shards)
    if args.num_state_pages is not None:
        num_pages = (budget - args.num_state_pages * state) // history
        if num_pages < 2:
            raise ValueError(
                f"num_state_pages {args.num_state_pages} ({state} bytes each) leave no page of "
                f"{history} bytes in a cache budget of {budget} bytes"
            )
        return int(num_pages), args.num_state_pages
    if not args.state_pool_share:
        return None
    return split_pool_pages(
        budget, history, state, share=args.state_pool_share, min_state_pages=min_state_pages(layout)
    )


def host_tier_pages(args: EngineArgs, runtime_config: Any, layout: CacheLayout, multi: bool) -> int:
    """Pages of the host KV tier of `args.kv_offloading_size` GiB: one device page's bytes each
    (every layer's pools at one page id, as on the device). ValueError where it cannot run."""
    from tokenspeed_jax.runtime.host_tier import host_pages_for
    from tokenspeed_jax.runtime.state import bytes_per_page

    if multi:
        raise ValueError("kv_offloading_size is not supported on the multi-process runtime yet")
    if not args.enable_prefix_cache:
        raise ValueError("kv_offloading_size needs the prefix cache (it keeps evicted prefix pages)")
    per_page = bytes_per_page(runtime_config, layout.layer_groups, layout.page_sizes, args.kv_cache_dtype)
    pages = host_pages_for(args.kv_offloading_size, per_page)
    if pages < 1:
        raise ValueError(
            f"kv_offloading_size {args.kv_offloading_size} GiB holds no page of {per_page} bytes"
        )
    return pages
