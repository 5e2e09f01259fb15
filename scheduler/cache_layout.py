"""`CacheLayout`: the one setup value the Scheduler and the device runner share, built once by
`cache_layout` (so no page size, pool size or layer map reaches either side by a second road)."""

from __future__ import annotations

import dataclasses
from typing import Any

from scheduler.config import SchedulerConfig
from scheduler.coordinator import pool_indices
from scheduler.group_spec import group_specs_from_layer_types, layer_group_indices
from scheduler.step_ops import GroupLayout


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Everything both sides of a step must agree on. `LLM` builds the Scheduler from
    `scheduler_config` and hands this same value to the ModelRunner.

    scheduler_config: the Scheduler's config, its `groups` set to the model's cache groups.
    groups: `GroupLayout` (page_size, width W_g, delta_width N_g) per group, in config order.
    layer_groups: index into `groups` of each model layer's cache group.
    honor_full_refresh: False makes the device apply only tail deltas (the seed's aliasing bug,
        kept as a research ablation; `tokenspeed_jax.page_table.update_rows`).
    """

    scheduler_config: SchedulerConfig
    groups: tuple[GroupLayout, ...]
    layer_groups: tuple[int, ...]
    honor_full_refresh: bool = True

    @property
    def page_sizes(self) -> tuple[int, ...]:
        return tuple(g.page_size for g in self.groups)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(g.width for g in self.groups)

    @property
    def num_pages(self) -> int:  # page ids of the one shared pool (null page included)
        return self.scheduler_config.num_pages

    @property
    def max_live_requests(self) -> int:  # device page-table mirror slots
        return self.scheduler_config.num_live_slots

    @property
    def state_pages(self) -> int | None:  # page ids of the state groups' own pool (None: shared)
        return self.scheduler_config.state_pages

    @property
    def group_pages(self) -> tuple[int, ...]:
        """Page ids (null page included) of each group's pool: what its page ids index."""
        state = self.state_pages
        pages = (self.num_pages,) if state is None else (self.num_pages, state)
        return tuple(pages[i] for i in pool_indices(self.scheduler_config.group_specs, state is not None))

    def with_num_pages(self, num_pages: int, state_pages: int | None = None) -> CacheLayout:
        """The same layout over a pool of `num_pages` (sized once the groups are known), and a
        state pool of `state_pages` (None: the state groups share the one pool)."""
        config = dataclasses.replace(self.scheduler_config, num_pages=num_pages, state_pages=state_pages)
        return dataclasses.replace(self, scheduler_config=config)

    def with_host_pages(self, host_pages: int) -> CacheLayout:
        """The same layout with a host KV tier of `host_pages` pages (`scheduler.host_tier`)."""
        config = dataclasses.replace(self.scheduler_config, host_pages=host_pages)
        return dataclasses.replace(self, scheduler_config=config)


def cache_layout(
    config: SchedulerConfig,
    model: Any,
    *,
    conv_page_size: int = 8,
    honor_full_refresh: bool = True,
    state_page_size: int | None = None,
) -> CacheLayout:
    """The layout of `model` (anything with `layer_types`, `sliding_window`, `conv_L_cache`: a
    `ModelConfig`) under `config`: full_attention -> full-history group of `config.page_size`-token
    pages; sliding_attention -> sliding group (W = sliding_window, same pages); conv -> live-tail
    sliding group (W = conv_L_cache, `conv_page_size`-token pages); linear_attention, mamba ->
    state group of `state_page_size`-token pages (None: `config.page_size`; a snapshot per page).
    `config.groups` is replaced."""
    specs = group_specs_from_layer_types(
        layer_types=tuple(model.layer_types),
        sliding_window_tokens=model.sliding_window,
        page_size=config.page_size,
        conv_page_size=conv_page_size,
        conv_kernel_size=model.conv_L_cache if "conv" in model.layer_types else None,
        state_page_size=state_page_size,
    )
    config = dataclasses.replace(config, groups=specs)
    return CacheLayout(
        scheduler_config=config,
        groups=config.group_layouts(),
        layer_groups=tuple(layer_group_indices(model.layer_types, specs)),
        honor_full_refresh=honor_full_refresh,
    )
