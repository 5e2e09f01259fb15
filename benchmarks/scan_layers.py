"""Scan over layers vs unrolled layers (issue 21): compile time, executable size, step time, tokens.

    python benchmarks/scan_layers.py                         # tiny-random
    python benchmarks/scan_layers.py --model /path/to/smollm2-hf --max-context-len 2048 \
        --max-batch-requests 64 --max-scheduled-tokens 2048 --shapes 16x256,16x2048,256x2048,2048x2048

Both engines are built in this process from the same checkpoint (`LLM(..., scan_layers=False |
True)`, no compilation cache, so every compile is cold). Per chosen step shape (token bucket x
kv tokens; default: the smallest and the largest of each): trace + lowering and XLA seconds (one
shape at a time), the serialized executable's size (what the executable cache stores and a warm
start reads), and the median time of an all-padding step of that shape (dense work only: the CPU
attention runs real tokens only, docs/performance.md). Then greedy generation of the same prompts both
ways: equal tokens, and the largest logprob difference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# benchmarks/ first on sys.path would let scheduler.py (a benchmark) shadow the scheduler package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._engine_args import add_engine_args, llm_kwargs, padding_step_ms  # noqa: E402


def measure(args, scan: bool, wanted: list[tuple[int, int]] | None) -> dict:
    from jax.experimental.serialize_executable import serialize

    from tokenspeed_jax import LLM, SamplingParams

    kw = llm_kwargs(args, compile_cache_dir=False, lazy_compile="sync", scan_layers=scan)
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    load_s = time.perf_counter() - t0
    runner = llm.engine.runner
    padding = llm.engine.scheduler.padding_ops()
    levels = runner.shapes.kv_levels
    shapes = sorted(runner.shapes.warmup_shapes(padding))
    if wanted is not None:
        shapes = [s for s in shapes if (s.bucket, levels[s.level][0]) in wanted]
    else:
        buckets, lv = [s.bucket for s in shapes], [s.level for s in shapes]
        shapes = [
            s for s in shapes if s.bucket in (min(buckets), max(buckets)) and s.level in (min(lv), max(lv))
        ]
    rows = {}
    for shape in shapes:
        compiled = runner.programs.prepare(shape)
        rec = runner.programs.record_of(shape)
        size = len(serialize(compiled)[0])
        rows[(shape.bucket, levels[shape.level][0])] = dict(
            trace=rec.trace_s,
            xla=rec.compile_s,
            mb=size / 2**20,
            ms=padding_step_ms(runner, padding, shape, args.reps),
        )
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    prompts = [rng.integers(1, vocab, n).tolist() for n in (12, 40, 7, 90)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=True))
    return dict(
        load_s=load_s,
        rows=rows,
        tokens=[o.token_ids for o in outs],
        logprobs=[o.logprobs for o in outs],
        runs=[(r.start, r.stop) for r in runner._scan.runs] if scan else None,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--shapes",
        default=None,
        help="comma-separated TOKENSxKV shapes (default: smallest / largest of each)",
    )
    args = p.parse_args()
    wanted = None
    if args.shapes:
        wanted = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]

    plain, scanned = measure(args, False, wanted), measure(args, True, wanted)
    print(
        f"\n## scan_layers: {args.model}, {args.dtype}, batch {args.max_batch_requests}, "
        f"{args.max_scheduled_tokens} tokens/step; runs {scanned['runs']}; jax "
        f"{jax.__version__}, {jax.devices()[0].platform}\n"
    )
    print(
        "| tokens x kv | trace s (unrolled / scan) | XLA s | executable MB | step ms | step scan/unrolled |"
    )
    print("|---|---|---|---|---|---|")
    tot = {k: 0.0 for k in ("pt", "st", "px", "sx")}
    for key in sorted(plain["rows"]):
        a, b = plain["rows"][key], scanned["rows"][key]
        tot["pt"] += a["trace"]
        tot["st"] += b["trace"]  # noqa: E702
        tot["px"] += a["xla"]
        tot["sx"] += b["xla"]  # noqa: E702
        print(
            f"| {key[0]} x {key[1]} | {a['trace']:.1f} / {b['trace']:.1f} | {a['xla']:.1f} / "
            f"{b['xla']:.1f} | {a['mb']:.1f} / {b['mb']:.1f} | {a['ms']:.1f} / {b['ms']:.1f} | "
            f"{b['ms'] / a['ms']:.2f} |"
        )
    print(
        f"\ntrace + XLA over these shapes: unrolled {tot['pt'] + tot['px']:.1f} s, scan "
        f"{tot['st'] + tot['sx']:.1f} s ({(tot['st'] + tot['sx']) / (tot['pt'] + tot['px']):.2f}x)"
        f"; load {plain['load_s']:.1f} / {scanned['load_s']:.1f} s"
    )
    same = sum(x == y for x, y in zip(plain["tokens"], scanned["tokens"], strict=True))
    diff = max(
        abs(x - y)
        for xs, ys in zip(plain["logprobs"], scanned["logprobs"], strict=True)
        for x, y in zip(xs, ys)
        if x is not None and y is not None
    )
    print(f"greedy sequences equal: {same}/{len(plain['tokens'])}; max |logprob diff| {diff:.2e}")


if __name__ == "__main__":
    main()
