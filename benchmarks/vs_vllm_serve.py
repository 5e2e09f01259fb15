"""Served throughput against vLLM CPU on the same checkpoint (issues 22, 44), one load generator.

    python benchmarks/vs_vllm_serve.py --model /path/to/smollm2-hf \\
        --vllm-python /path/to/vllm-venv/bin/python [--dtype float32] [--reps 3]

Servers (`--engines`, default ours,vllm,vllm-both): `tokenspeed-jax serve`, `vllm serve` as
installed (`vllm`: on x86 vLLM CPU reserves one core per rank for its scheduler process, so on
2 cores its model runs on one OpenMP thread) and `vllm serve` with every core (`vllm-both`:
VLLM_CPU_NUM_OF_RESERVED_CPU=0), all on the same HF dir with the same step budget (our
`--max-scheduled-tokens` / `--max-batch-requests` = vLLM's `--max-num-batched-tokens` /
`--max-num-seqs`: this script's `--max-scheduled-tokens` (2048, vLLM CPU's serving default) and
`--max-batch` (32)) and the same KV cache bytes (`--kv-cache-gib`, 4: vLLM's
`VLLM_CPU_KVCACHE_SPACE`, our `--kv-cache-memory-bytes`). They start one at a time, each until
its `/health` answers (ours makes its step shapes ready before listening, vLLM compiles its
graphs), and stay up; each then gets one untimed warm-up pass with `--warm-seed`'s prompts
(1). The load: vLLM's own `vllm bench serve --backend openai` (random dataset: `--prefix-len`
shared + `--input-len` random tokens per prompt, `--output-len` tokens with EOS ignored,
`--num-prompts` at `--max-concurrency`). Then `--reps` (3) rounds: each round drives every
server once, one at a time (the others' processes stopped: an idle vLLM polls), the starting
server rotated per round, with that round's prompts (seed `--seed` + round: new to every prefix
cache, the same for every server).
Every request must complete with exactly `--output-len` tokens or the run fails (exit status 1).
Prints each server's thread binding, per-metric median (min-max) (out / total tok/s, TTFT and
TPOT p50 / p99, duration, cores busy), and ours / vLLM's better config (higher median out
tok/s). The load generator runs on the same 2 cores as the server it drives, alike for all.
`vllm bench serve` runs through a wrapper that answers `importlib.metadata.version("vllm")` with
the vllm-cpu version + "+cpu" (../shared/peers/vllm-cpu.md). Without --vllm-python (or when vllm
does not import there) it says so and exits 0: there is no load generator.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _peer / _machine

from _machine import cpu_line  # noqa: E402
from _peer import (  # noqa: E402
    better_vllm,
    binding_line,
    check_lengths,
    interleave,
    is_vllm,
    kill_tree,
    log_tail,
    med_range,
    ours_env,
    paired_ratio,
    vllm_env,
    vllm_importable,
    waiting_line,
)

_WRAPPER = r"""
import importlib.metadata as md, sys
_real = md.version
def version(name):
    if name == "vllm":
        return _real("vllm-cpu") + "+cpu"
    return _real(name)
md.version = version
if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this file
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm"] + sys.argv[1:]
    main()
"""

_METRICS = (
    ("output_throughput", "out tok/s"),
    ("total_token_throughput", "total tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("duration", "duration s"),
    ("busy_cores", "cores busy"),
)


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float, log: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode} before it was healthy; "
                f"the end of its log:\n{log_tail(log)}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server on port {port} not healthy after {timeout_s} s")


def _bench(args: argparse.Namespace, port: int, out_dir: str, tag: str, seed: int) -> dict[str, Any]:
    """One `vllm bench serve` pass against the server on `port`; its result JSON, every
    request checked complete with exactly --output-len tokens."""
    cmd = [
        args.vllm_python,
        args.wrapper,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        "model",
        "--tokenizer",
        args.model,
        "--dataset-name",
        "random",
        "--random-prefix-len",
        str(args.prefix_len),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        out_dir,
        "--result-filename",
        f"{tag}.json",
    ]
    proc = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, f"{tag}.json")) as f:
        res: dict[str, Any] = json.load(f)
    lens = res.get("output_lens", [])
    check_lengths(tag, lens + [0] * (args.num_prompts - len(lens)), args.output_len)
    for key in (
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "generated_texts",
        "errors",
        "start_times",
    ):  # per-request detail: checked, not kept
        res.pop(key, None)
    return res


def _engine_steps(port: int) -> int:
    """Our server's engine steps so far (/stats)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=30) as r:
        return int(json.load(r)["num_engine_steps"])


def _serve(engine: str, args: argparse.Namespace, port: int, log: str) -> subprocess.Popen:
    if engine == "ours":
        env = ours_env()
        cmd = [
            sys.executable,
            "-m",
            "tokenspeed_jax.cli",
            "serve",
            "--model",
            args.model,
            "--dtype",
            args.dtype,
            "--max-context-len",
            "2048",
            "--port",
            str(port),
            "--served-model-name",
            "model",
            "--kv-cache-memory-bytes",
            f"{args.kv_cache_gib}G",
            "--max-scheduled-tokens",
            str(args.max_scheduled_tokens),
            "--max-batch-requests",
            str(args.max_batch),
            *shlex.split(args.ours_args),
        ]
    else:
        env = vllm_env(args.kv_cache_gib, engine)
        cmd = [
            args.vllm_python,
            args.wrapper,
            "serve",
            args.model,
            "--dtype",
            args.dtype,
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            str(args.max_batch),
            "--max-num-batched-tokens",
            str(args.max_scheduled_tokens),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "model",
        ]
    with open(log, "w") as f:  # the server holds its own copy of the file
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def _servers(
    engines: list[str], args: argparse.Namespace, d: str
) -> Iterator[dict[str, tuple[subprocess.Popen, int, str]]]:
    """Start the servers one at a time (a starting server would slow the others' starts), each
    healthy and through its warm-up pass before the next; stop them all at the end."""
    up: dict[str, tuple[subprocess.Popen, int, str]] = {}
    try:
        for i, engine in enumerate(engines):
            port, log = args.port + i, os.path.join(d, f"{engine}-server.log")
            t = time.perf_counter()
            up[engine] = (proc := _serve(engine, args, port, log), port, log)
            _wait_healthy(port, proc, args.start_timeout_s, log)
            _bench(args, port, d, f"{engine}-warm", args.warm_seed)
            print(
                f"{engine}: up and warm in {time.perf_counter() - t:.1f} s; "
                f"{binding_line(engine, proc.pid, log)}",
                flush=True,
            )
        yield up
    finally:
        for proc, _, _ in up.values():
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint dir both load")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--engines",
        default="ours,vllm,vllm-both",
        help="ours, vllm (vLLM CPU's default binding), vllm-both (VLLM_CPU_NUM_OF_RESERVED_CPU=0)",
    )
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument(
        "--max-scheduled-tokens",
        type=int,
        default=2048,
        help="tokens per step: ours --max-scheduled-tokens, vLLM --max-num-batched-tokens",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=32,
        help="requests per step: ours --max-batch-requests, vLLM --max-num-seqs",
    )
    p.add_argument("--reps", type=int, default=3, help="timed rounds, every server once each")
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--start-timeout-s", type=float, default=1800)
    p.add_argument("--warm-seed", type=int, default=1, help="seed of the warm-up pass's prompts")
    p.add_argument(
        "--seed",
        type=int,
        default=100,
        help="round r's prompts: seed --seed + r (keep away from --warm-seed)",
    )
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache bytes of both servers")
    p.add_argument(
        "--ours-args", default="", help="more `tokenspeed-jax serve` flags, one shell-quoted string"
    )
    args = p.parse_args()
    args.model = os.path.abspath(args.model)
    print(f"CPU: {cpu_line()}", flush=True)
    if not vllm_importable(args.vllm_python):
        print(
            "vllm-cpu is not importable from --vllm-python: no load generator "
            "(../shared/peers/vllm-cpu.md says how to install it)"
        )
        return
    engines = args.engines.split(",")
    with tempfile.TemporaryDirectory() as d:
        args.wrapper = os.path.join(d, "vllm_cli.py")
        with open(args.wrapper, "w") as f:
            f.write(_WRAPPER)
        with _servers(engines, args, d) as up:

            def run(engine: str, r: int) -> dict[str, Any]:
                port = up[engine][1]
                before = _engine_steps(port) if engine == "ours" else 0
                res = _bench(args, port, d, f"{engine}-{r}", args.seed + r)
                res["busy_s"] = res["duration"]  # the load generator's own start excluded
                if engine == "ours":
                    res["steps"] = _engine_steps(port) - before
                return res

            results = interleave(engines, args.reps, run, lambda e: up[e][0].pid)
            bindings = [binding_line(e, proc.pid, log) for e, (proc, _, log) in up.items()]
    _report(args, results, bindings)


def _report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], bindings: list[str]) -> None:
    print(
        f"\n## served vs vLLM CPU: {args.model}, {args.dtype}, {args.num_prompts} prompts of "
        f"{args.prefix_len} shared + {args.input_len} random tokens, {args.output_len} out "
        f"(all checked), concurrency {args.max_concurrency}, {args.max_scheduled_tokens} "
        f"tokens / {args.max_batch} requests per step, {args.kv_cache_gib} GiB KV cache each, "
        f"{args.reps} interleaved reps, median (min-max)"
        + (f", ours with `{args.ours_args}`" if args.ours_args else "")
        + f"\n\nCPU: {cpu_line()}\n"
    )
    print("| server | " + " | ".join(label for _, label in _METRICS) + " |")
    print("|---|" + "---|" * len(_METRICS))
    for engine, rs in results.items():
        print(
            f"| {engine} | "
            + " | ".join(
                med_range([r.get(key, float("nan")) for r in rs], ".2f" if key == "busy_cores" else ".1f")
                for key, _ in _METRICS
            )
            + " |"
        )
    out = {e: [r["output_throughput"] for r in rs] for e, rs in results.items()}
    best = better_vllm(out)
    print()
    if "ours" in out and best:
        o, v = results["ours"], results[best]
        ttft = statistics.median(r["median_ttft_ms"] for r in o) / statistics.median(
            r["median_ttft_ms"] for r in v
        )
        tpot = statistics.median(r["median_tpot_ms"] for r in o) / statistics.median(
            r["median_tpot_ms"] for r in v
        )
        print(
            f"ours / vLLM's better ({best}) out tok/s: {paired_ratio(out['ours'], out[best])}; "
            f"TTFT p50 {ttft:.2f}x, TPOT p50 {tpot:.2f}x of {best}'s (below 1: ours lower)"
        )
    if "ours" in results:
        steps = [r["steps"] for r in results["ours"]]
        ms = [r["duration"] / max(r["steps"], 1) * 1e3 for r in results["ours"]]
        print(f"ours: engine steps per timed pass {med_range(steps, '.0f')}, ms per step {med_range(ms)}")
    print("\n".join(f"- {b}" for b in bindings))
    for e, rs in results.items():
        print(f"- while {e} ran, the waiting servers' CPU-s, at most: {waiting_line(rs)}")
    if not any(is_vllm(e) for e in results):
        print("(no vLLM server ran: no ratio)")


if __name__ == "__main__":
    main()
