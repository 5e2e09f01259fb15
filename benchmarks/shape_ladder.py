"""What each step shape costs to compile and what it buys at run time (issue 21).

    python benchmarks/shape_ladder.py                        # tiny-random
    python benchmarks/shape_ladder.py --model /path/to/smollm2-hf --max-context-len 2048 \
        --max-batch-requests 64 --max-scheduled-tokens 2048

For every (token bucket, kv level) of the engine's ladder: the trace + lowering and XLA compile
time (no executable cache, so each is a real cold compile; one shape at a time unless
`--workers`), and the step
time of an all-padding step of that shape (median of `--reps`; dense work only: the CPU
attention runs real tokens only, docs/performance.md). Then, per shape, the step time of the
smallest *coarser* shape that covers it, i.e. what a step pays if this shape is left out of the
ladder (`step_programs`: a missing shape runs as its smallest ready cover). The last column,
compile seconds / per-step saving in ms, is how many steps at this shape it takes to earn its
compile back.
"""

from __future__ import annotations

import argparse
import os
import sys

# `python benchmarks/shape_ladder.py` puts benchmarks/ first on sys.path, where scheduler.py (the
# scheduler benchmark) would shadow the scheduler package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._engine_args import add_engine_args, llm_kwargs, padding_step_ms  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="compile threads (1: one shape at a time, uncontended compile times)",
    )
    args = p.parse_args()

    from tokenspeed_jax import LLM

    llm = LLM(args.model, **llm_kwargs(args, compile_cache_dir=False, lazy_compile="sync"))
    runner = llm.engine.runner
    padding = llm.engine.scheduler.padding_ops()
    shapes = sorted(runner.shapes.warmup_shapes(padding))
    if args.workers > 1:  # compile times are then per thread, `workers` at a time
        runner.programs.prepare_many(shapes, workers=args.workers, progress=True)
    step_ms: dict = {}
    for shape in shapes:
        step_ms[shape] = padding_step_ms(runner, padding, shape, args.reps)
    recs = {r.shape: r for r in runner.programs.records}
    levels = runner.shapes.kv_levels
    print(
        f"\n## step shapes: {args.model}, {args.dtype}, batch {args.max_batch_requests}, "
        f"{args.max_scheduled_tokens} tokens/step, backend {runner.backend}; "
        f"jax {jax.__version__}, {jax.devices()[0].platform}\n"
    )
    print(
        "| tokens | kv tokens | trace s | XLA s | step ms | cover | cover step ms | "
        "saving ms | steps to repay |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    total_c = 0.0
    for shape in shapes:
        r = recs[shape]
        total_c += r.trace_s + r.compile_s
        covers = [s for s in shapes if s != shape and s.bucket >= shape.bucket and s.level >= shape.level]
        cover = min(covers) if covers else None
        if cover is None:
            tail = "| - | - | - | - |"
        else:
            saving = step_ms[cover] - step_ms[shape]
            repay = (r.trace_s + r.compile_s) / (saving / 1e3) if saving > 0 else float("inf")
            tail = (
                f"| {cover.bucket}x{levels[cover.level][0]} | {step_ms[cover]:.1f} | "
                f"{saving:.1f} | {repay:.0f} |"
            )
        print(
            f"| {shape.bucket} | {levels[shape.level][0]} | {r.trace_s:.1f} | {r.compile_s:.1f} "
            f"| {step_ms[shape]:.1f} {tail}"
        )
    print(
        f"\n{len(shapes)} shapes, {total_c:.1f} s of trace + compile in all "
        f"(one at a time); {np.mean([recs[s].compile_s for s in shapes]):.1f} s XLA per shape"
    )


if __name__ == "__main__":
    main()
