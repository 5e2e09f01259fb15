"""Cache-group specs, specs from model layer types, and pool sizing (DESIGN.md §8)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, cast

from scheduler.block_table import ceil_div

Retention = Literal["full_history", "sliding_window"]
Family = Literal["history", "state"]

LAYER_TYPE_GROUPS = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "state",
    "mamba": "state",
    "conv": "conv",
}


@dataclasses.dataclass(frozen=True)
class PagedCacheGroupSpec:
    """One cache group: the layers that share a retention policy.

    A page holds `rows_per_page` rows of `entry_stride_tokens` tokens each, i.e.
    `P = rows_per_page * entry_stride_tokens` tokens; `block_size` (tokens per scheduler page)
    defaults to P. (SPEC.md's fields; our code builds with `make(page_size=)`, reads `page_size`.)
    """

    group_id: str
    retention: Retention
    rows_per_page: int
    entry_stride_tokens: int
    sliding_window_tokens: int | None
    family: Family = "history"
    block_size: int | None = None
    live_tail_alloc: bool = False

    def __post_init__(self) -> None:
        g = self.group_id
        if self.retention not in ("full_history", "sliding_window"):
            raise ValueError(f"group {g!r}: unknown retention {self.retention!r}")
        if self.family not in ("history", "state"):
            raise ValueError(f"group {g!r}: unknown family {self.family!r}")
        for name in ("rows_per_page", "entry_stride_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"group {g!r}: {name} must be a positive int, got {value!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size <= 0):
            raise ValueError(f"group {g!r}: block_size must be a positive int, got {self.block_size!r}")
        if self.retention == "sliding_window":
            w = self.sliding_window_tokens
            if not isinstance(w, int) or w <= 0:
                raise ValueError(
                    f"group {g!r}: a sliding group needs a positive sliding_window_tokens, got {w!r}"
                )
        if self.live_tail_alloc and self.retention != "sliding_window":
            raise ValueError(f"group {g!r}: live_tail_alloc is only valid on sliding groups")
        if self.family == "state" and self.retention != "sliding_window":
            raise ValueError(f"group {g!r}: a state group must use sliding_window retention")

    @classmethod
    def make(
        cls,
        group_id: str,
        retention: Retention,
        *,
        page_size: int,
        sliding_window_tokens: int | None = None,
        family: Family = "history",
        live_tail_alloc: bool = False,
    ) -> PagedCacheGroupSpec:
        """A group of `page_size`-token pages (one token per row), built by keyword."""
        return cls(
            group_id,
            retention,
            rows_per_page=page_size,
            entry_stride_tokens=1,
            sliding_window_tokens=sliding_window_tokens,
            family=family,
            live_tail_alloc=live_tail_alloc,
        )

    @property
    def page_size(self) -> int:
        """Tokens per page of this group (SPEC's `block_size`, defaulting to P)."""
        if self.block_size is not None:
            return self.block_size
        return self.rows_per_page * self.entry_stride_tokens


def group_specs_from_layer_types(
    *,
    layer_types: list[str] | tuple[str, ...],
    sliding_window_tokens: int | None,
    page_size: int,
    conv_kernel_size: int | None = None,
    conv_page_size: int = 8,
    state_page_size: int | None = None,
) -> list[PagedCacheGroupSpec]:
    """One group per kind of layer present, in order of first appearance.

    full_attention -> "full" (full history, `page_size` tokens per page); sliding_attention ->
    "sliding" (window `sliding_window_tokens`); linear_attention, mamba -> "state" (W = 2 state group);
    conv -> "conv": a live-tail sliding group with window = `conv_kernel_size` and
    `conv_page_size`-token pages (each token's conv input is stored position-addressed).
    """
    if not layer_types:
        raise ValueError("layer_types is empty")
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    specs: dict[str, PagedCacheGroupSpec] = {}
    for i, layer_type in enumerate(layer_types):
        kind = LAYER_TYPE_GROUPS.get(layer_type)
        if kind is None:
            raise ValueError(
                f"layer {i}: unknown layer type {layer_type!r} (known: {sorted(LAYER_TYPE_GROUPS)})"
            )
        if kind in specs:
            continue
        make = PagedCacheGroupSpec.make
        if kind == "full":
            spec = make("full", "full_history", page_size=page_size)
        elif kind == "sliding":
            if not sliding_window_tokens or sliding_window_tokens <= 0:
                raise ValueError(
                    f"layer {i} ({layer_type}) needs a positive "
                    f"sliding_window_tokens, got {sliding_window_tokens!r}"
                )
            spec = make(
                "sliding", "sliding_window", page_size=page_size, sliding_window_tokens=sliding_window_tokens
            )
        elif kind == "state":
            spec = make(
                "state",
                "sliding_window",
                page_size=state_page_size or page_size,
                sliding_window_tokens=2,
                family="state",
            )
        else:
            if not conv_kernel_size or conv_kernel_size <= 0:
                raise ValueError(
                    f"layer {i} (conv) needs a positive conv_kernel_size, got {conv_kernel_size!r}"
                )
            spec = make(
                "conv",
                "sliding_window",
                page_size=conv_page_size,
                sliding_window_tokens=conv_kernel_size,
                live_tail_alloc=True,
            )
        specs[kind] = spec
    return list(specs.values())


def layer_group_indices(layer_types: Sequence[str], specs: list[PagedCacheGroupSpec]) -> list[int]:
    """Index into `specs` of the group each layer belongs to (the one layer -> group map)."""
    index = {spec.group_id: i for i, spec in enumerate(specs)}
    out = []
    for i, layer_type in enumerate(layer_types):
        kind = LAYER_TYPE_GROUPS.get(layer_type)
        if kind is None or kind not in index:
            raise ValueError(f"layer {i}: no cache group for layer type {layer_type!r}")
        out.append(index[kind])
    return out


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def compute_paged_cache_group_page_counts(
    specs: list[PagedCacheGroupSpec],
    *,
    max_live_requests: int,
    max_scheduled_tokens: int,
    max_total_tokens: int,
    max_context_len: int,
    decode_input_tokens: int = 1,
    overlap_schedule_depth: int = 0,
    safety_margin: int = 0,
) -> dict[str, int]:
    """Pages each group needs (null page included), per DESIGN.md §8."""
    _check_counts(
        max_live_requests=max_live_requests,
        max_scheduled_tokens=max_scheduled_tokens,
        max_total_tokens=max_total_tokens,
        max_context_len=max_context_len,
        decode_input_tokens=decode_input_tokens,
        safety_margin=safety_margin,
    )
    if overlap_schedule_depth not in (0, 1):
        raise ValueError(f"overlap_schedule_depth must be 0 or 1, got {overlap_schedule_depth!r}")
    r, s, t, c = max_live_requests, max_scheduled_tokens, max_total_tokens, max_context_len
    out: dict[str, int] = {}
    for spec in specs:
        p = spec.rows_per_page * spec.entry_stride_tokens  # DESIGN.md §8's P
        protected = r * ceil_div(overlap_schedule_depth * decode_input_tokens, p)
        if spec.family == "state":
            core = min(2 * r + t // p, ceil_div(t, p) + r)
        elif spec.retention == "full_history":
            core = ceil_div(t, p) + r
        else:
            w = cast(int, spec.sliding_window_tokens)  # set for every sliding group
            core = r * ceil_div(min(w - 1, c), p) + ceil_div(min(s, t), p) + r
        out[spec.group_id] = core + protected + 1 + safety_margin
    return out


def compute_max_logical_pages_for_capture(
    spec: PagedCacheGroupSpec,
    *,
    max_context_len: int,
    max_tokens_per_req: int = 1,
    overlap_schedule_depth: int = 0,
) -> int:
    """Page-table width a captured (fixed-shape) step needs for this group (DESIGN.md §8)."""
    _check_counts(max_context_len=max_context_len, max_tokens_per_req=max_tokens_per_req)
    if overlap_schedule_depth not in (0, 1):
        raise ValueError(f"overlap_schedule_depth must be 0 or 1, got {overlap_schedule_depth!r}")
    p = spec.rows_per_page * spec.entry_stride_tokens  # DESIGN.md §8's P
    extra = (overlap_schedule_depth + 1) * max_tokens_per_req
    if spec.retention == "full_history":
        return ceil_div(max_context_len + extra, p)
    w = cast(int, spec.sliding_window_tokens)  # set for every sliding group
    return ceil_div(min(w, max_context_len) + extra, p) + 1
