"""Speculative decoding on the host: the n-gram (prompt-lookup) proposer and its config.

Each step, a decode row whose request may speculate proposes up to k draft tokens: the longest
suffix of its tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) that occurred
earlier in prompt + output, and the (up to k) tokens that followed its most recent earlier
occurrence. The row then runs 1 + d query tokens (its last token and the d drafts); the device
verifies the drafts (`tokenspeed_jax.runtime.spec_verify.verify_drafts`) and returns how many it accepted; the
scheduler keeps the accepted prefix plus the device's own next token and rolls the rest back
(`CacheCoordinator.truncate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

METHODS = ("ngram",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for n-gram speculation.

    num_speculative_tokens: k, the most drafts one row proposes per step (>= 1).
    prompt_lookup_max / prompt_lookup_min: the longest / shortest suffix n-gram matched.
    padding_only (ours, not vLLM's): drafts only fill the padding of the token bucket the
        step's one-token rows already occupy, shared evenly among the rows (`draft_budget`), so
        a speculative step costs what the plain step costs where the step's cost follows its
        token count (CPUs, compute-bound hosts). False: up to k drafts per row whatever the
        bucket (memory-bound accelerators, where a bigger bucket costs little).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    padding_only: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got "
                             f"{self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.padding_only, bool):
            raise ValueError(f"speculative_config.padding_only must be a bool, got "
                             f"{self.padding_only!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"> prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or vLLM's dict spelling (unknown keys: ValueError)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**dict(value))


def draft_budget(spec: SpeculativeConfig, num_rows: int, token_buckets: tuple[int, ...],
                 max_rows: int) -> tuple[int, int]:
    """(draft tokens the step may carry, the most one row may carry) for a step of `num_rows`
    running requests (capped at `max_rows`) on a runner with `token_buckets` (ascending; () =
    unknown: no padding limit). With `padding_only`, the step's drafts fill the padding of the
    smallest bucket holding its one-token rows, shared evenly (at least one per row while any
    padding is left)."""
    k = spec.num_speculative_tokens
    rows = min(num_rows, max_rows)
    if not spec.padding_only or not token_buckets or rows == 0:
        return rows * k, k
    bucket = next((b for b in token_buckets if b >= rows), token_buckets[-1])
    budget = max(0, bucket - rows)
    return budget, min(k, max(1, budget // rows))


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k drafts continuing `tokens`: the tokens after the most recent earlier occurrence
    of the longest suffix n-gram (n_max down to n_min); [] when no suffix recurs.

    Searched as bytes (`bytes.rfind`, C speed): an int32 match must also sit on a 4-byte
    boundary, so unaligned hits are skipped."""
    size = len(tokens)
    if k < 1 or size < n_min + 1:
        return []
    buf = np.asarray(tokens, np.int32).tobytes()
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = buf[(size - n) * 4:]
        end = (size - 1) * 4  # earlier occurrences end before the last token
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                first = at // 4 + n
                return list(tokens[first:first + k])
            end = at + len(pattern) - 1
    return []
