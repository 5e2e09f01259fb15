"""What the single-engine benchmarks share: the engine flags, the `LLM` keywords they make, and
the timing of one step shape on all-padding inputs (the dense work is fixed per shape; the CPU
attention loops over real tokens only, so an all-padding step times everything BUT the
attention: docs/performance.md)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def add_engine_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """Every engine flag (`tokenspeed_jax.engine_args.add_cli_args`: the CLI's defaults, a pool
    of 1024 pages unless --kv-cache-memory-bytes, and a benchmark's own `defaults` over them)."""
    from tokenspeed_jax.engine_args import add_cli_args

    add_cli_args(p, **{"num_pages": 1024, **defaults})


def llm_kwargs(args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    """`LLM(args.model, **llm_kwargs(args, ...))`: the `add_engine_args` options that differ
    from `LLM`'s defaults (plain values: they travel to child processes as JSON), plus `more`."""
    from tokenspeed_jax.engine_args import EngineArgs, cli_options

    base = EngineArgs()
    kw = {k: v for k, v in cli_options(args).items() if k != "model" and v != getattr(base, k)}
    return {**kw, **more}


def padding_step_ms(runner: Any, padding: Any, shape: Any, reps: int, *, warm: int = 1) -> float:
    """Median milliseconds of `reps` all-padding steps of `shape` after `warm` untimed ones
    (made ready first if it is not: compiled, or read from the executable store). No attention
    work on the reference backend: its loops run the step's real tokens only."""
    import jax

    from tokenspeed_jax.runtime.step_inputs import pack

    runner.programs.prepare(shape)
    i32, f32 = pack(padding, runner.step_layout(shape))
    times = []
    for _ in range(warm + reps):
        t = time.perf_counter()
        jax.block_until_ready(runner.execute(shape, i32, f32))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[warm:])
