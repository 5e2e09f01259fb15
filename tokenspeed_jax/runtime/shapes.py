"""The host shape policy of the jitted step: which (token bucket, kv level) a `StepOps` runs as.

A step's shape key is (token bucket, kv bucket); the step compiles once per key.
* token bucket: the token dimension is padded up to the smallest of the powers of two from
  `min_token_bucket` up to `max_scheduled_tokens` (always a bucket), so a decode step does not
  pay for a full prefill's worth of padding (`token_buckets`); with `lone_decode` a 1-token
  bucket comes first, so a lone decode reads the weights for one row, not `min_token_bucket`
  (on CPU the Linears' cost grows with the rows even when they are padding: 3x per token);
* kv bucket (reference backend): the page tables the attention / conv reads get only the columns
  that cover the step's longest row, rounded up to a ladder of powers of two of tokens from
  `min_kv_bucket` (`kv_levels`), so the jnp reference gathers K/V in proportion to the real
  context, not to `max_context_len`. The Pallas kernels bound their loops by kv_len themselves
  and always see the full width (one kv level: their compile count is unchanged).

Host only (no jax): the single-process and the multi-process runner share one policy.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from scheduler.step_ops import StepOps
from tokenspeed_jax.engine_args import DEFAULT_MIN_KV_BUCKET

DEFAULT_MIN_TOKEN_BUCKET = 16  # tokens: the shortest power-of-two token bucket

KvLevel = tuple[int, tuple[int, ...]]  # (tokens covered, kv columns per group)


class StepShape(NamedTuple):
    """The compiled shape of one step: its token bucket and its index into `kv_levels`."""

    bucket: int
    level: int


def token_buckets(
    max_scheduled_tokens: int, min_bucket: int = DEFAULT_MIN_TOKEN_BUCKET, *, lone_decode: bool = False
) -> tuple[int, ...]:
    """Powers of two from `min_bucket` below `max_scheduled_tokens`, then the max itself;
    `lone_decode` puts a 1-token bucket first (when `min_bucket` > 1)."""
    out, b = [1] if lone_decode and min_bucket > 1 else [], max(1, min_bucket)
    while b < max_scheduled_tokens:
        out.append(b)
        b *= 2
    return (*out, max_scheduled_tokens)


def kv_levels(widths: tuple[int, ...], page_sizes: tuple[int, ...], min_tokens: int) -> tuple[KvLevel, ...]:
    """The kv-bucket ladder: (tokens covered, kv columns per group), shortest first.

    Levels are `min_tokens * 2^i` tokens (a power of two of pages when `min_tokens` is one) while
    shorter than the widest group's capacity, then the full mirror widths. Group g reads
    `min(W_g, ceil(tokens / B_g))` columns at a level; duplicates collapse.
    """
    cap = max(w * b for w, b in zip(widths, page_sizes, strict=True))
    levels, seen, t = [], set(), max(1, min_tokens)
    while t < cap:
        cols = tuple(min(w, -(-t // b)) for w, b in zip(widths, page_sizes, strict=True))
        if cols not in seen:
            levels.append((t, cols))
            seen.add(cols)
        t *= 2
    full = tuple(widths)
    if full not in seen:
        levels.append((cap, full))
    return tuple(levels)


@dataclasses.dataclass(frozen=True)
class ShapePolicy:
    """The token buckets and the kv levels of one runner, and how a step picks among them.

    buckets: ascending token buckets, the last = max_scheduled_tokens (`token_buckets`).
    kv_levels: ascending (tokens, kv columns per group), the last = the full mirror widths.
    """

    buckets: tuple[int, ...]
    kv_levels: tuple[KvLevel, ...]

    @classmethod
    def build(
        cls,
        widths: tuple[int, ...],
        page_sizes: tuple[int, ...],
        max_scheduled_tokens: int,
        *,
        backend: str,
        min_token_bucket: int = DEFAULT_MIN_TOKEN_BUCKET,
        min_kv_bucket: int = DEFAULT_MIN_KV_BUCKET,
        lone_decode: bool = False,
    ) -> ShapePolicy:
        """The policy of a runner over mirrors of `widths` pages of `page_sizes` tokens per
        group; `backend` is the resolved attention backend ("reference" | "native" | "pallas");
        `lone_decode`: a 1-token bucket below `min_token_bucket` (`token_buckets`)."""
        if backend in ("reference", "native"):  # jnp paths: tables cut to the kv bucket
            levels = kv_levels(widths, page_sizes, min_kv_bucket)
        else:  # Pallas: loops bounded by kv_len on the device; one full-width level
            levels = ((max(w * b for w, b in zip(widths, page_sizes)), tuple(widths)),)
        return cls(token_buckets(max_scheduled_tokens, min_token_bucket, lone_decode=lone_decode), levels)

    @property
    def shape_keys(self) -> tuple[tuple[int, int], ...]:
        """Every (token bucket, kv bucket tokens) pair a step can have: one compile each."""
        return tuple((b, t) for b in self.buckets for t, _ in self.kv_levels)

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest token bucket holding `num_tokens` tokens."""
        for b in self.buckets:
            if num_tokens <= b:
                return b
        raise ValueError(f"num_tokens {num_tokens} > max_scheduled_tokens {self.buckets[-1]}")

    def kv_level_for(self, ops: StepOps) -> int:
        """Index of the shortest kv level covering the step's longest row (`kv_lens`) and every
        refreshed row's length (`row_lens`, in columns per group)."""
        need = int(ops.kv_lens.max())
        row_lens = [int(g.row_lens.max()) for g in ops.groups]
        for level, (tokens, cols) in enumerate(self.kv_levels):
            if tokens >= need and all(c >= n for c, n in zip(cols, row_lens)):
                return level
        return len(self.kv_levels) - 1

    def step_shape(self, ops: StepOps) -> StepShape:
        """The compiled shape of a non-empty step."""
        return StepShape(self.bucket_for(int(ops.num_tokens)), self.kv_level_for(ops))

    def warmup_levels(self, max_kv_len: int | None = None) -> tuple[int, ...]:
        """The kv levels a warm-up compiles: all of them (None), or those up to the one
        covering `max_kv_len` tokens (all of them when none covers it)."""
        top = len(self.kv_levels) - 1
        if max_kv_len is not None:
            if max_kv_len < 1:
                raise ValueError(f"max_kv_len must be >= 1, got {max_kv_len}")
            top = next((i for i, (t, _) in enumerate(self.kv_levels) if t >= max_kv_len), top)
        return tuple(range(top + 1))

    def warmup_shapes(self, padding_ops: StepOps, max_kv_len: int | None = None) -> tuple[StepShape, ...]:
        """The shapes a warm-up runs `padding_ops` as, in order: every token bucket x
        `warmup_levels(max_kv_len)`. `padding_ops` must hold no row (its writes all drop)."""
        if padding_ops.num_seqs:
            raise ValueError(f"warmup needs an all-padding StepOps, got {padding_ops.num_seqs} rows")
        levels = self.warmup_levels(max_kv_len)
        return tuple(StepShape(b, lv) for b in self.buckets for lv in levels)
