"""`CacheLayout`: the one setup value the scheduler and the device runner share.

`cache_layout(config, model)` derives, once, everything both sides of a step must agree on: the
cache groups (from the model's layer types and `config.page_size`), each group's page size and
page-table widths, the shared pool size, the layer -> group map and `honor_full_refresh`. `LLM`
builds the Scheduler from `layout.scheduler_config` and hands the same value to the ModelRunner,
so no page size, pool size or layer map travels by a second road.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from scheduler.config import SchedulerConfig
from scheduler.group_spec import PagedCacheGroupSpec, group_specs_from_layer_types, layer_group_indices
from scheduler.step_ops import GroupLayout


class CacheModel(Protocol):
    """The model facts the cache groups depend on (`tokenspeed_jax.models.ModelConfig` has them)."""

    @property
    def layer_types(self) -> Sequence[str]: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def conv_L_cache(self) -> int: ...


def model_group_specs(model: CacheModel, *, page_size: int,
                      conv_page_size: int = 8) -> list[PagedCacheGroupSpec]:
    """The model's cache groups: full_attention -> full history (`page_size`-token pages);
    sliding_attention -> sliding (W = sliding_window); conv -> live-tail sliding group with
    W = conv_L_cache and `conv_page_size`-token pages."""
    return group_specs_from_layer_types(
        layer_types=tuple(model.layer_types), sliding_window_tokens=model.sliding_window,
        page_size=page_size,
        conv_kernel_size=model.conv_L_cache if "conv" in model.layer_types else None,
        conv_page_size=conv_page_size)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Built by `cache_layout`; read by the Scheduler (its config) and the ModelRunner.

    scheduler_config: the Scheduler's config, its `groups` set to the model's cache groups.
    groups: `GroupLayout` (page_size, width W_g, delta_width N_g) per group, in config order.
    layer_groups: index into `groups` of each model layer's cache group.
    honor_full_refresh: False makes the device apply only tail deltas (the seed's aliasing bug,
        a research ablation; `tokenspeed_jax.page_table.update_rows`).
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
    def delta_widths(self) -> tuple[int, ...]:
        return tuple(g.delta_width for g in self.groups)

    @property
    def num_pages(self) -> int:
        """Page ids of the one shared pool (null page included)."""
        return self.scheduler_config.num_pages

    @property
    def max_live_requests(self) -> int:
        """Device page-table mirror slots."""
        return self.scheduler_config.num_live_slots

    def with_num_pages(self, num_pages: int) -> CacheLayout:
        """The same layout over a pool of `num_pages` (sized once the groups are known)."""
        config = dataclasses.replace(self.scheduler_config, num_pages=num_pages)
        return dataclasses.replace(self, scheduler_config=config)


def cache_layout(config: SchedulerConfig, model: CacheModel, *, conv_page_size: int = 8,
                 honor_full_refresh: bool = True) -> CacheLayout:
    """The model's cache groups of `config.page_size`-token pages (`model_group_specs`) put into
    a copy of `config`, their layouts and the layer -> group map (`layer_group_indices`)."""
    specs = model_group_specs(model, page_size=config.page_size, conv_page_size=conv_page_size)
    config = dataclasses.replace(config, groups=specs)
    return CacheLayout(scheduler_config=config, groups=config.group_layouts(),
                       layer_groups=tuple(layer_group_indices(model.layer_types, specs)),
                       honor_full_refresh=honor_full_refresh)
