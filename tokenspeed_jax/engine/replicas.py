"""Data-parallel request routing: the replica whose prefix cache holds the longest prefix of the
prompt wins (its pages are reused instead of recomputed); ties go to the least loaded replica
(running + waiting requests, plus any extra load the caller counts), then the lowest index."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenspeed_jax.engine.engine import Engine


def pick_replica(engines: Sequence[Engine], prompt: list[int],
                 extra_load: Callable[[int], int] | None = None) -> int:
    """Index of the replica that should serve `prompt` (callers hold whatever locks the engines
    need; `Scheduler.prefix_match_tokens` is read-only)."""
    if len(engines) == 1:
        return 0
    best, best_key = 0, None
    for i, e in enumerate(engines):
        load = e.scheduler.num_unfinished + (extra_load(i) if extra_load else 0)
        key = (-e.scheduler.prefix_match_tokens(prompt), load, i)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def aggregate_stats(per: list[dict]) -> dict:
    """Sum of the replicas' numeric counters (and per-group page dicts); see `LLM.stats`."""
    out = dict(per[0])
    for key, val in per[0].items():
        if isinstance(val, bool):
            continue
        if isinstance(val, (int, float)):
            out[key] = sum(s[key] for s in per)
        elif isinstance(val, dict) and all(isinstance(v, (int, float)) for v in val.values()):
            out[key] = {k: sum(s[key][k] for s in per) for k in val}
    q = out.get("prefix_query_tokens", 0)
    out["prefix_hit_rate"] = out.get("prefix_hit_tokens", 0) / q if q else 0.0
    out["replicas"] = per
    return out
