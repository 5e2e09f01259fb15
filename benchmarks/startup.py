"""Start-up time (issues 21, 44): cold (empty caches) vs warm, each start a fresh process.

    python benchmarks/startup.py                          # tiny-random: 3 rounds of cold + warm
    python benchmarks/startup.py --model DIR --max-context-len 2048 --max-batch-requests 64 \
        --max-scheduled-tokens 2048 --vllm-python /path/to/vllm-venv/bin/python \
        [--no-scan-layers | --also-unrolled]

Ready = the interpreter started, the engine built, every step shape compiled (ours: `warmup()`;
vLLM: its own compile and warm-up inside `LLM(...)`) and one greedy answer of exactly 16 tokens
(EOS ignored; checked) to 8 prompt ids, timed from outside the process (`ready s`).
`--vllm-python`: also vLLM CPU on the same checkpoint dir, both ways (`vllm`: its default thread
binding, one core reserved for its scheduler; `vllm-both`: VLLM_CPU_NUM_OF_RESERVED_CPU=0), with
the same step budget (`max_num_batched_tokens` / `max_num_seqs` = our `--max-scheduled-tokens` /
`--max-batch-requests`) and 4 GiB of KV cache (../shared/peers/vllm-cpu.md).

`--reps` (3) rounds; in each, every engine makes one cold start (ours: a fresh compile cache
dir, unless `--cache-dir`; vLLM: a fresh `VLLM_CACHE_ROOT` with torch's inductor cache under it,
so nothing of an earlier start is reused) and then `--warm` (1) warm starts on that cache: a real
restart, nothing survives but the cache files. Engines take turns within a round, the first
rotated per round. The OS file cache holds the checkpoint after the first start, for every
engine alike. Printed: the machine line, vLLM's thread binding, every start (import, load,
warm-up with shapes compiled / loaded, trace + XLA seconds, first answer, ready, whether the
answer equals the engine's first cold one), then cold and warm ready median (min-max) per engine
and ours / vLLM's faster config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
# `tokenspeed-jax bench startup` runs this file without benchmarks/ on sys.path
sys.path.insert(0, ROOT)
sys.path.insert(0, _HERE)

from _machine import cpu_line  # noqa: E402
from _peer import (  # noqa: E402
    VLLM_CONFIGS,
    check_lengths,
    is_vllm,
    med_range,
    ours_env,
    vllm_env,
    vllm_logged_binding,
)

from benchmarks._engine_args import add_engine_args, llm_kwargs  # noqa: E402

ANSWER_TOKENS = 16
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.runtime import compile_cache
kw = json.loads(sys.argv[1])
n, prompt = kw.pop("answer_tokens"), kw.pop("prompt")
t1 = time.perf_counter()
llm = LLM(**kw)
t2 = time.perf_counter()
shapes = llm.warmup()
t3 = time.perf_counter()
out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
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
if __name__ == "__main__":  # vLLM spawns its engine core process from this file
    kw = json.loads(sys.argv[1])
    t1 = time.perf_counter()
    llm = LLM(model=kw["model"], dtype=kw["dtype"], max_model_len=kw["max_context_len"],
              enable_prefix_caching=True, max_num_seqs=kw["max_batch_requests"],
              max_num_batched_tokens=kw["max_scheduled_tokens"], seed=0)
    t2 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": kw["prompt"]}],
                       SamplingParams(temperature=0, max_tokens=kw["answer_tokens"],
                                      ignore_eos=True), use_tqdm=False)[0]
    t3 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "warmup_s": 0.0, "answer_s": t3 - t2,
                      "shapes": 0, "tokens": list(out.outputs[0].token_ids), "entries": 0,
                      "compiled": 0, "loaded": 0, "trace_s": 0.0, "compile_s": 0.0}))
"""


def _timed_child(label: str, cmd: list[str], env: dict[str, str], cwd: str, log: str) -> dict[str, Any]:
    """Run one start in its own process (its output in `log`); its JSON line plus `ready_s`,
    the wall time of it all, its answer checked to have exactly ANSWER_TOKENS tokens."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=f, text=True)
        f.write(proc.stdout)  # vLLM logs on stdout: its thread binding is read from here
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        with open(log) as f:
            raise SystemExit(f.read()[-3000:])
    # vLLM may log after our line: take the last line that is our JSON
    out: dict[str, Any] = json.loads(
        next(x for x in reversed(proc.stdout.splitlines()) if x.startswith('{"import_s"'))
    )
    out["ready_s"] = wall
    check_lengths(f"{label}'s first answer", [len(out["tokens"])], ANSWER_TOKENS)
    return out


def _vllm_start(python: str, config: str, kw: dict[str, Any], cache_root: str) -> dict[str, Any]:
    script = os.path.join(cache_root, "vllm_child.py")
    with open(script, "w") as f:
        f.write(_VLLM_CHILD)
    # torch's inductor cache lives in /tmp by default, outside VLLM_CACHE_ROOT: a "cold" start
    # would reuse an earlier start's kernels
    env = dict(
        vllm_env(4, config),
        VLLM_CACHE_ROOT=cache_root,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_root, "inductor"),
    )
    log = os.path.join(cache_root, f"start-{time.monotonic_ns()}.log")
    out = _timed_child(config, [python, script, json.dumps(kw)], env, cache_root, log)
    out["binding"] = vllm_logged_binding(log)
    return out


def _ours_start(kw: dict[str, Any], log_dir: str) -> dict[str, Any]:
    log = os.path.join(log_dir, f"ours-{time.monotonic_ns()}.log")
    return _timed_child("ours", [sys.executable, "-c", _CHILD, json.dumps(kw)], ours_env(), ROOT, log)


def _start(
    engine: str, cache: str, args: argparse.Namespace, kw: dict[str, Any], vkw: dict[str, Any], log_dir: str
) -> dict[str, Any]:
    """One start of `engine` on the cache dir `cache` (vLLM: its VLLM_CACHE_ROOT)."""
    if is_vllm(engine):
        return _vllm_start(args.vllm_python, engine, vkw, cache)
    scan = {"scan_layers": False} if engine == "ours-unrolled" else {}
    return _ours_start(dict(kw, compile_cache_dir=cache, **scan), log_dir)


def _round(
    r: int,
    engines: list[str],
    args: argparse.Namespace,
    kw: dict[str, Any],
    vkw: dict[str, Any],
    log_dir: str,
) -> list[tuple[str, str, dict[str, Any]]]:
    """Round r: per engine (the first rotated by r), a cold start then --warm warm ones."""
    starts = []
    for engine in [engines[(r + i) % len(engines)] for i in range(len(engines))]:
        given = args.cache_dir if not is_vllm(engine) else None
        cache = given or tempfile.mkdtemp(prefix=f"{engine}-startup-", dir=args.scratch)
        for i in range(1 + args.warm):
            kind = "warm" if i else ("start" if given else "cold")
            res = _start(engine, cache, args, kw, vkw, log_dir)
            starts.append((engine, kind, res))
            print(f"round {r + 1} {engine} {kind}: ready in {res['ready_s']:.1f} s", flush=True)
    return starts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--reps", type=int, default=3, help="rounds: a cold start of every engine")
    p.add_argument("--warm", type=int, default=1, help="warm restarts after each cold one")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="ours: this compile cache dir for every start (default: a fresh temp dir per round, cold first)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vllm-cpu: also start vLLM on --model (a dir)",
    )
    p.add_argument(
        "--vllm-engines",
        default=",".join(VLLM_CONFIGS),
        help="which vLLM configs: vllm (its default binding), vllm-both",
    )
    p.add_argument(
        "--also-unrolled",
        action="store_true",
        help="also start ours without scan_layers (`ours-unrolled`; plain ours: --scan-layers, the "
        "CPU default), in the same rounds",
    )
    args = p.parse_args()
    print(f"CPU: {cpu_line()}", flush=True)
    kw = llm_kwargs(args, model=args.model, answer_tokens=ANSWER_TOKENS, prompt=PROMPT)
    vkw = dict(
        model=os.path.abspath(args.model),
        dtype=args.dtype,
        max_context_len=args.max_context_len or 2048,
        max_batch_requests=args.max_batch_requests,
        max_scheduled_tokens=args.max_scheduled_tokens,
        answer_tokens=ANSWER_TOKENS,
        prompt=PROMPT,
    )
    ours = ["ours", "ours-unrolled"] if args.also_unrolled else ["ours"]
    engines = ours + (args.vllm_engines.split(",") if args.vllm_python else [])
    # every cache and log this run makes, removed at the end (hundreds of MB per vLLM start)
    with tempfile.TemporaryDirectory(prefix="tokenspeed-startup-") as args.scratch:
        starts = [s for r in range(args.reps) for s in _round(r, engines, args, kw, vkw, args.scratch)]
    _report(args, engines, starts)


def _report(
    args: argparse.Namespace, engines: list[str], starts: list[tuple[str, str, dict[str, Any]]]
) -> None:
    first = {e: next(r["tokens"] for x, _, r in starts if x == e) for e in engines}
    print(
        f"\n## start-up: {args.model}, {args.dtype}, batch {args.max_batch_requests}, "
        f"{'scan_layers, ' if args.scan_layers else ''}"
        f"{args.max_scheduled_tokens} tokens/step, {args.num_pages} pages; {args.reps} rounds "
        f"of cold + {args.warm} warm\n\nCPU: {cpu_line()}\n"
    )
    print(
        "| start | import s | load s | warmup s (shapes: compiled / loaded) | trace + XLA s "
        "(summed over threads) | first answer s | ready s | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for engine, kind, r in starts:
        warm = "-" if is_vllm(engine) else (f"{r['warmup_s']:.1f} ({r['compiled']} / {r['loaded']})")
        xla = "-" if is_vllm(engine) else f"{r['trace_s']:.1f} + {r['compile_s']:.1f}"
        print(
            f"| {engine} {kind} | {r['import_s']:.1f} | {r['load_s']:.1f} | {warm} | {xla} | "
            f"{r['answer_s']:.2f} | {r['ready_s']:.1f} | {r['tokens'] == first[engine]} |"
        )
    ready = {
        (e, k): [r["ready_s"] for x, kk, r in starts if x == e and kk == k]
        for e in engines
        for k in ("cold", "start", "warm")
    }
    print()
    for (e, k), xs in ready.items():
        if xs:
            print(f"- {e} {k} ready s: {med_range(xs)}")
    for e in engines:
        binding = next((r.get("binding") for x, _, r in starts if x == e and r.get("binding")), None)
        if binding:
            print(f"- {e} binding (vLLM log): {binding}")
    for k in ("cold", "warm"):
        peers = {e: xs for (e, kk), xs in ready.items() if kk == k and is_vllm(e) and xs}
        for ours in (e for e in engines if not is_vllm(e) and ready[(e, k)] and peers):
            best = min(peers, key=lambda e: statistics.median(peers[e]))
            print(
                f"- {k} ready, {ours} / vLLM's faster ({best}): "
                f"{statistics.median(ready[(ours, k)]) / statistics.median(peers[best]):.2f}x "
                "(below 1: ours starts faster)"
            )


if __name__ == "__main__":
    main()
