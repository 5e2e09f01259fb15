"""Start-up time (issue 21): cold (empty compilation cache) vs warm, each start a fresh process.

    python benchmarks/startup.py                          # tiny-random, 1 cold + 2 warm starts
    python benchmarks/startup.py --model smollm2-135m --max-context-len 2048 --max-batch-requests 64

Ready = `LLM(...)` built + `warmup()` (every step shape compiled) + one greedy request answered.
Each start runs in its own interpreter against one cache directory (a temp dir unless
`--cache-dir`), so "warm" is a real restart: nothing survives but the cache files. Printed per
start: load (LLM built), warmup (shapes), first answer, ready (the sum, from interpreter start,
imports included), cache entries after it, and whether the answer's tokens equal the cold one's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.runtime import compile_cache
kw = json.loads(sys.argv[1])
t1 = time.perf_counter()
llm = LLM(**kw)
t2 = time.perf_counter()
shapes = llm.warmup()
t3 = time.perf_counter()
out = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12]], SamplingParams(max_tokens=16))[0]
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "warmup_s": t3 - t2,
                  "answer_s": t4 - t3, "shapes": shapes, "tokens": out.token_ids,
                  "entries": compile_cache.num_entries()}))
"""


def _start(kw: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(kw)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["ready_s"] = wall
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--max-context-len", type=int, default=None)
    p.add_argument("--max-batch-requests", type=int, default=32)
    p.add_argument("--max-scheduled-tokens", type=int, default=512)
    p.add_argument("--num-pages", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--warm", type=int, default=2, help="warm restarts after the cold one")
    p.add_argument("--cache-dir", default=None, help="default: a fresh temp dir (cold first)")
    args = p.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="tokenspeed-startup-")
    kw = dict(model=args.model, max_batch_requests=args.max_batch_requests,
              max_scheduled_tokens=args.max_scheduled_tokens, num_pages=args.num_pages,
              dtype=args.dtype, compile_cache_dir=cache)
    if args.max_context_len is not None:
        kw["max_context_len"] = args.max_context_len
    runs = [("cold" if args.cache_dir is None else "start 1", _start(kw))]
    runs += [(f"warm {i + 1}", _start(kw)) for i in range(args.warm)]
    base = runs[0][1]["tokens"]
    print(f"\n## start-up: {args.model}, {args.dtype}, batch {args.max_batch_requests}, "
          f"{args.max_scheduled_tokens} tokens/step, {args.num_pages} pages; cache {cache}\n")
    print("| start | import s | load s | warmup s (shapes) | first answer s | ready s | "
          "cache entries | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs:
        print(f"| {name} | {r['import_s']:.1f} | {r['load_s']:.1f} | {r['warmup_s']:.1f} "
              f"({r['shapes']}) | {r['answer_s']:.2f} | {r['ready_s']:.1f} | {r['entries']} | "
              f"{r['tokens'] == base} |")
    warm = [r["ready_s"] for name, r in runs[1:]]
    if warm:
        print(f"\nwarm / cold ready: {min(warm) / runs[0][1]['ready_s']:.2f}")


if __name__ == "__main__":
    main()
