"""The served load replayed at the engine level: where its step time goes, per step shape (issue 22).

    python benchmarks/served_replay.py --model /path/to/smollm2-hf [--dtype float32]

`benchmarks/vs_vllm_serve.py`'s load without HTTP: `--num-prompts` prompts of `--prefix-len`
shared + `--input-len` random ids, `--output-len` tokens each (EOS ignored, temperature 1.0 as
`vllm bench serve` leaves it), at most `--max-concurrency` in flight (a new one added whenever
one finishes), through `Engine.step` in the synchronous loop, so each step's wall time is its
own. The step shapes are made ready first (as `serve` does before listening; a timed pass that
compiled in the background would measure the compiler too), then one untimed pass of the first
`--max-concurrency` prompts. Prints out tok/s and a table of the timed pass's steps by kind
(decode-only or mixed) and token bucket: count, median ms, total seconds.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from benchmarks._engine_args import add_engine_args, llm_kwargs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, max_context_len=2048)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    args = p.parse_args()

    from tokenspeed_jax import LLM, SamplingParams

    llm = LLM(args.model, **llm_kwargs(args, async_scheduling=False))
    engine, runner = llm.engine, llm.engine.runner
    t = time.perf_counter()
    engine.warmup(max_kv_len=args.prefix_len + args.input_len + args.output_len)
    print(f"step shapes ready in {time.perf_counter() - t:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    hi = engine.vocab_size - 1  # random token ids, as `--dataset-name random` sends
    prefix = rng.integers(1, hi, args.prefix_len).tolist()
    prompts = [prefix + rng.integers(1, hi, args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)

    steps: list[tuple[int, int, float]] = []  # (tokens, rows, ms) of each step
    dispatch, collect = runner.dispatch, runner.collect
    started: dict[str, object] = {}

    def timed_dispatch(ops, *more):
        started["t"], started["shape"] = time.perf_counter(), (ops.num_tokens, ops.num_seqs)
        return dispatch(ops, *more)

    def timed_collect(handle):
        result = collect(handle)
        steps.append((*started["shape"], 1e3 * (time.perf_counter() - started["t"])))
        return result

    runner.dispatch, runner.collect = timed_dispatch, timed_collect

    def replay(batch: list[list[int]], tag: str) -> float:
        queue, in_flight, t0 = list(enumerate(batch)), 0, time.perf_counter()
        while queue or engine.has_unfinished():
            while queue and in_flight < args.max_concurrency:
                i, prompt = queue.pop(0)
                engine.add_request(prompt, params, request_id=f"{tag}{i}")
                in_flight += 1
            in_flight -= len(engine.step())
        return time.perf_counter() - t0

    replay(prompts[: args.max_concurrency], "warm")
    steps.clear()
    wall = replay(prompts, "r")
    out_tokens = args.num_prompts * args.output_len
    print(
        f"\n{args.model}, {args.dtype}: {args.num_prompts} x ({args.prefix_len} shared + "
        f"{args.input_len}) -> {args.output_len}, concurrency {args.max_concurrency}: "
        f"{wall:.1f} s, {out_tokens / wall:.1f} out tok/s, {len(steps)} steps\n"
    )
    buckets = runner.buckets
    groups: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    for tokens, rows, ms in steps:
        bucket = min((b for b in buckets if b >= tokens), default=tokens)
        groups[("decode" if tokens == rows else "mixed", bucket)].append(ms)
    print("| steps | token bucket | count | median ms | total s |")
    print("|---|---|---|---|---|")
    for (kind, bucket), times in sorted(groups.items()):
        print(
            f"| {kind} | {bucket} | {len(times)} | {statistics.median(times):.1f} | {sum(times) / 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
