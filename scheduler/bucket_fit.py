"""Prefill chunks sized to the runner's token buckets.

A step runs padded to the smallest compiled token bucket that holds it, and on a CPU padding
tokens cost as much dense compute as real ones. A served step is typically some decodes plus one
newly arrived prompt: 15 decodes + a 256-token prompt = 271 tokens, which runs in the 512 bucket,
nearly half of it padding (SmolLM2 f32 on a 2-core VM: ~1.4 s instead of ~0.7 s). Cutting the
prompt's chunk to 241 tokens makes the step exactly 256; its last 15 tokens ride along with the
next step's decodes, where they cost a few milliseconds. Chunked prefill is exact, so only the
request's first token moves, by one step.

The rule (`fit_chunk`): a chunk is cut to end the step at the largest bucket below the step's
size when what it defers is at most half the padding it saves; otherwise it stays whole (a step
that only just spills into a much larger bucket keeps more of its tokens in flight than padding
would waste).
"""

from __future__ import annotations

import bisect

__all__ = ["fit_chunk"]


def fit_chunk(used: int, n: int, after: int, buckets: tuple[int, ...]) -> int:
    """Tokens to schedule of a prefill chunk that wants `n` (>= 1) tokens, when `used` tokens
    are already planned in the step and `after` one-token decode rows will follow it.
    buckets: the runner's ascending token buckets (() = unknown: `n` unchanged). Returns a value
    in [1, n]."""
    total = used + n + after
    if not buckets or n <= 1 or total > buckets[-1]:
        return n
    i = bisect.bisect_left(buckets, total)  # buckets[i] >= total: the step's bucket
    if i == 0 or buckets[i] == total:
        return n  # the smallest bucket, or no padding at all
    lo, hi = buckets[i - 1], buckets[i]
    keep = lo - used - after
    deferred = n - keep
    if keep < 1 or 2 * deferred > hi - lo:
        return n
    return keep
