"""Batch-1 decode against the weight-read bound (issue 22), one run.

    python benchmarks/batch1.py --model /path/to/smollm2-hf [--dtypes float32,bfloat16]
                                [--buckets default,16] [--prompts 6] [--max-tokens 64]

A lone request decodes one token per step, and each step reads every weight once: the
machine's copy bandwidth over the parameter bytes is the bound on tokens per second. This
measures that bandwidth (numpy copy of a 512 MiB array: bytes read + written, best of 5),
then, for each dtype and each `min_token_bucket` ("default": the engine's, whose CPU ladder has
a 1-token bucket for a lone decode; 16: a lone decode runs the model on 16 rows),
runs `--prompts` chat prompts one at a time (`--max-tokens` greedy tokens each, EOS ignored)
after one untimed pass; decode time is each request's time minus that of a one-token request
of the same prompt. Prints decode tok/s, the bound and the share of it reached.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tokenspeed_jax import LLM, SamplingParams  # noqa: E402
from tokenspeed_jax.workloads.chat_prompts import ChatPrompts  # noqa: E402

SYSTEM = ("You are a concise assistant for a public library help desk. Answer in one or two "
          "short sentences.")


def copy_bandwidth(nbytes: int = 512 << 20) -> float:
    """Bytes per second moved (read + written) by a numpy copy, best of 5."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def run(model: str, dtype: str, bucket: int | None, args: argparse.Namespace) -> tuple[float, int]:
    """(decode tok/s over the timed pass, parameter bytes)."""
    llm = LLM(model, dtype=dtype, min_token_bucket=bucket, max_batch_requests=8,
              max_scheduled_tokens=256, max_context_len=2048,
              attention_backend=args.attention_backend,
              compile_cache_dir=False)
    params = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
    chats = ChatPrompts(llm.tokenizer, system=SYSTEM)
    prompts = [chats.first(i) for i in range(args.prompts)]
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for p in prompts:  # the prompts' first prefills
        llm.generate([p], sp)

    def timed_pass() -> float:
        """decode time = a full request minus a one-token request of the same prompt (both find
        the prompt in the prefix cache): what is left is max_tokens - 1 decode steps."""
        decode_s = 0.0
        for p in prompts:
            t0 = time.perf_counter()
            llm.generate([p], SamplingParams(max_tokens=1))
            t1 = time.perf_counter()
            out = llm.generate([p], sp)[0]
            decode_s += time.perf_counter() - t1 - (t1 - t0)
            assert len(out.token_ids) == args.max_tokens
        return decode_s

    # once untimed: a cached prompt's last partial page is a short prefill, another token bucket
    # than the first pass used. A lazily compiled shape runs as a covering one while its own
    # compiles on a background thread, which must not share the 2 cores with the timed pass
    # (reading 28.4 tok/s for 35.7, and single requests 2x slower)
    timed_pass()
    llm.engine.runner.programs.wait_background()
    decode_s = timed_pass()
    tokens = len(prompts) * (args.max_tokens - 1)
    return tokens / decode_s, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--buckets", default="default,16",
                   help="min_token_bucket values to compare (default: the engine's)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--attention-backend", default="auto",
                   help="auto (native on CPU), native, reference")
    args = p.parse_args()
    from _machine import cpu_line  # benchmarks/ is sys.path[0] when run as a script

    bw = copy_bandwidth()
    rows = []
    for dtype in args.dtypes.split(","):
        for bucket in (None if b == "default" else int(b) for b in args.buckets.split(",")):
            tps, params = run(args.model, dtype, bucket, args)
            rows.append((dtype, bucket, tps, params, bw / params))
            print(f"{dtype} min_token_bucket={bucket or 'default'}: {tps:.1f} tok/s", flush=True)
    print(f"\n## batch-1 decode: {args.model}, {args.prompts} chat prompts one at a time, "
          f"{args.max_tokens} tokens each; jax {jax.__version__}\n\nCPU: {cpu_line()}; copy "
          f"bandwidth {bw / 1e9:.1f} GB/s\n")
    print("| dtype | min_token_bucket | decode tok/s | params MB | weight-read bound tok/s | "
          "share of bound |")
    print("|---|---|---|---|---|---|")
    for dtype, bucket, tps, params, bound in rows:
        print(f"| {dtype} | {bucket or 'default'} | {tps:.1f} | {params / 1e6:.0f} | {bound:.1f} | "
              f"{tps / bound:.0%} |")


if __name__ == "__main__":
    main()
