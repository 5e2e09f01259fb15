"""Shared fixtures of the runtime tests (the worker subprocesses of parallel_worker.py,
test_distributed.py and test_kv_replication.py run those files as scripts, where `tests.*` is
not importable; they never need these)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

LogprobLists = Sequence[Sequence[float | None] | None]


def _max_logprob_diff(a: LogprobLists, b: LogprobLists) -> float:
    """max |x - y| over two runs' per-request logprob lists; None (no logprobs asked for, or no
    logprob at that position) must sit at the same places in both."""
    worst = 0.0
    for xs, ys in zip(a, b, strict=True):
        assert (xs is None) == (ys is None)
        for x, y in zip(xs or [], ys or [], strict=True):
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                worst = max(worst, abs(x - y))
    return worst


@pytest.fixture
def max_logprob_diff() -> Callable[[LogprobLists, LogprobLists], float]:
    return _max_logprob_diff
