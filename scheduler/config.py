"""`SchedulerConfig`: every number that fixes the scheduler's policy and the StepOps shapes."""

from __future__ import annotations

import dataclasses
from typing import cast

from scheduler.block_table import ceil_div
from scheduler.group_spec import PagedCacheGroupSpec
from scheduler.speculative import SpeculativeConfig
from scheduler.step_ops import GroupLayout


@dataclasses.dataclass
class SchedulerConfig:
    """Scheduler settings. StepOps shapes depend only on these.

    groups: cache groups (None = one full-history group of `page_size` tokens per page);
        `scheduler.cache_layout` sets a model's groups, built from `page_size`.
    max_live_requests: device page-table mirror slots (requests holding pages at once);
        None = max_batch_requests.
    decode_reserve_tokens: decode tokens promised (and reserved) when a first chunk is admitted.
    enable_adoption: repoint a just-computed page to an existing canonical copy and free it.
    max_prefill_chunk_tokens: cap on one request's prefill chunk per step (None = the whole
        token budget), so one long prompt cannot take a step's budget from everyone else.
    debug_checks: after every schedule/update run `check_invariants()` and the tail-only mirror
        comparison (slow; for tests and debugging).
    speculative: n-gram speculative decoding (`scheduler.speculative`; None = off; a dict in
        vLLM's `speculative_config` spelling is accepted).
    state_snapshots: when a state group's page is registered for the prefix cache: "chunk_end"
        (DESIGN.md: only the page ending exactly at a chunk end, the one snapshot a device that
        writes final states holds) or "every_page" (every completed page: for a device that
        writes the state at every page end, as tokenspeed_jax's recurrent layers do).
    host_pages: pages of the host KV tier below the device pool (`scheduler.host_tier`;
        0 = no tier): evicted prefix pages are kept there and loaded back on a hit.
    state_pages: page ids of a pool of their own for the recurrent-state groups (null page
        included; `scheduler.coordinator`), so attention pages do not pay for state snapshots
        nor snapshots for K/V. None: every group shares the one pool of `num_pages`
        (DESIGN.md §2). Needs a state group beside another group and no host tier.
    """

    num_pages: int
    page_size: int = 16
    max_batch_requests: int = 64
    max_scheduled_tokens: int = 2048
    max_context_len: int = 8192
    groups: list[PagedCacheGroupSpec] | None = None
    enable_prefix_cache: bool = True
    max_live_requests: int | None = None
    decode_reserve_tokens: int = 1
    enable_adoption: bool = True
    max_prefill_chunk_tokens: int | None = None
    debug_checks: bool = False
    speculative: SpeculativeConfig | None = None
    state_snapshots: str = "chunk_end"
    host_pages: int = 0
    state_pages: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_pages",
            "page_size",
            "max_batch_requests",
            "max_scheduled_tokens",
            "max_context_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if self.num_pages < 2:
            raise ValueError(
                f"SchedulerConfig.num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}"
            )
        if self.max_live_requests is not None and self.max_live_requests <= 0:
            raise ValueError(
                f"SchedulerConfig.max_live_requests must be positive, got {self.max_live_requests}"
            )
        if self.max_prefill_chunk_tokens is not None and self.max_prefill_chunk_tokens <= 0:
            raise ValueError(
                f"SchedulerConfig.max_prefill_chunk_tokens must be positive, got "
                f"{self.max_prefill_chunk_tokens}"
            )
        if self.decode_reserve_tokens < 0:
            raise ValueError(
                f"SchedulerConfig.decode_reserve_tokens must be >= 0, got {self.decode_reserve_tokens}"
            )
        if not isinstance(self.host_pages, int) or self.host_pages < 0:
            raise ValueError(f"SchedulerConfig.host_pages must be an int >= 0, got {self.host_pages!r}")
        if self.state_snapshots not in ("chunk_end", "every_page"):
            raise ValueError(
                "SchedulerConfig.state_snapshots must be 'chunk_end' or 'every_page', "
                f"got {self.state_snapshots!r}"
            )
        if self.groups is None:
            self.groups = [PagedCacheGroupSpec.make("full", "full_history", page_size=self.page_size)]
        elif not self.groups:
            raise ValueError("SchedulerConfig.groups is empty")
        self.speculative = SpeculativeConfig.parse(self.speculative)
        if self.speculative is not None:
            self._check_speculative(self.speculative)
        if self.state_pages is not None:
            self._check_state_pages(self.state_pages)

    def _check_state_pages(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(
                "SchedulerConfig.state_pages must be None or an int >= 2 (page 0 is the null page), "
                f"got {n!r}"
            )
        families = {g.family for g in self.group_specs}
        if families != {"state", "history"}:
            raise ValueError(
                "SchedulerConfig.state_pages needs a recurrent-state group beside another group, "
                f"got groups {[g.group_id for g in self.group_specs]}"
            )
        if self.host_pages:
            raise ValueError("SchedulerConfig.state_pages with host_pages: the host tier needs one pool")

    @property
    def group_specs(self) -> list[PagedCacheGroupSpec]:
        """`groups` after construction (None became the one full-history group)."""
        assert self.groups is not None
        return self.groups

    def _check_speculative(self, spec: SpeculativeConfig) -> None:
        k = spec.num_speculative_tokens
        if k + 1 > self.max_scheduled_tokens:
            raise ValueError(
                f"speculative_config.num_speculative_tokens {k} + 1 exceeds "
                f"max_scheduled_tokens {self.max_scheduled_tokens}"
            )
        for g in self.group_specs:
            if g.family == "state":
                raise ValueError(
                    f"speculative decoding is not supported with recurrent-state "
                    f"cache group {g.group_id!r} (its state cannot roll back)"
                )
            if g.live_tail_alloc:
                # A live-tail group decides real pages vs holes at the acquire's frontier; the
                # drafts must not push it past a slot the accepted frontier still reads.
                limit = g.page_size + cast(int, g.sliding_window_tokens) - 3
                if k > limit:
                    raise ValueError(
                        f"speculative_config.num_speculative_tokens {k} exceeds "
                        f"{limit} for live-tail cache group {g.group_id!r} (page "
                        f"size {g.page_size}, window {g.sliding_window_tokens})"
                    )

    @property
    def num_live_slots(self) -> int:
        return self.max_live_requests or self.max_batch_requests

    def group_layouts(self) -> tuple[GroupLayout, ...]:
        """Static shape facts of every group: page size, mirror width
        W_g = ceil(max_context_len / page_size), delta width N_g = min(W_g, ceil(T / page_size) + 1)."""
        out = []
        for spec in self.group_specs:
            width = ceil_div(self.max_context_len, spec.page_size)
            delta = min(width, ceil_div(self.max_scheduled_tokens, spec.page_size) + 1)
            out.append(
                GroupLayout(group_id=spec.group_id, page_size=spec.page_size, width=width, delta_width=delta)
            )
        return tuple(out)
