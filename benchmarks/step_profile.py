"""Where one jitted step's time goes, per XLA:CPU thunk kind (issue 22; docs/performance.md).

    python benchmarks/step_profile.py --model /path/to/smollm2-hf --dtype bfloat16 [--tokens 16]

Builds the engine (no compilation cache), compiles the smallest kv level of the `--tokens`
bucket, runs a few all-padding steps of it (the dense work is fixed per shape; the CPU
attention runs real tokens only, so it is absent from this profile: docs/performance.md),
then `--reps` more under `jax.profiler.trace(create_perfetto_trace=True)` and sums the trace's
complete events per thunk: by name with its numeric suffix dropped (`wrapped_convert.210` ->
`wrapped_convert`), in ms per step, with how many ran per step. The step's wall time (median,
outside the profiler) comes first.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

# benchmarks/ first on sys.path would let scheduler.py (a benchmark) shadow the scheduler package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402

from benchmarks._engine_args import add_engine_args, llm_kwargs, padding_step_ms  # noqa: E402

_HOST = ("$", "Thunk", "Pjit", "end: ", "Common", "Parse", "Handle")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, max_batch_requests=64, max_scheduled_tokens=2048, max_context_len=2048)
    p.add_argument("--tokens", type=int, default=16, help="token bucket of the profiled step")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()

    from tokenspeed_jax import LLM
    from tokenspeed_jax.runtime.step_inputs import pack

    llm = LLM(args.model, **llm_kwargs(args, compile_cache_dir=False, lazy_compile="sync"))
    runner = llm.engine.runner
    padding = llm.engine.scheduler.padding_ops()
    shape = min(
        (s for s in runner.shapes.warmup_shapes(padding) if s.bucket >= args.tokens),
        key=lambda s: (s.bucket, s.level),
    )
    step_ms = padding_step_ms(runner, padding, shape, args.reps, warm=3)
    i32, f32 = pack(padding, runner.step_layout(shape))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(args.reps):
                jax.block_until_ready(runner.execute(shape, i32, f32))
        path = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(_HOST):
            kind = re.sub(r"\.\d+$", "", e["name"])
            total[kind] += e.get("dur", 0)
            count[kind] += 1
    kv = runner.shapes.kv_levels[shape.level][0]
    print(
        f"\n## step profile: {args.model}, {args.dtype}, {shape.bucket} tokens x kv {kv}, "
        f"batch {args.max_batch_requests}; jax {jax.__version__}\n"
    )
    print(f"step wall time (median of {args.reps}, unprofiled): {step_ms:.1f} ms\n")
    print("| thunk kind | ms per step (summed over threads) | per step |")
    print("|---|---|---|")
    for kind, us in total.most_common(args.top):
        print(f"| {kind} | {us / args.reps / 1e3:.1f} | {count[kind] // args.reps} |")


if __name__ == "__main__":
    main()
