"""Served throughput against vLLM CPU on the same checkpoint (issue 22), one load generator.

    python benchmarks/vs_vllm_serve.py --model /path/to/smollm2-hf \\
        --vllm-python /path/to/vllm-venv/bin/python [--dtype float32]

Starts `tokenspeed-jax serve` and then `vllm serve` on the same HF dir (one at a time, each
until its `/health` answers: ours makes its step shapes ready before listening, vLLM compiles
its graphs), and drives each with vLLM's own `vllm bench serve --backend openai` (random
dataset: `--prefix-len` shared + `--input-len` random tokens per prompt, `--output-len` tokens
with EOS ignored, `--num-prompts` at `--max-concurrency`), after one untimed warm-up pass of
the same shape of load with other prompts (`--warm-seed`, 1; the timed pass has seed 0), so the
timed prompts are new to both prefix caches: `--warm-seed 0` re-sends the warm-up's prompts,
and then each engine computes what its cache kept of them (vLLM CPU's 128-token blocks keep
256 of a 384-token prompt, our 16-token pages 368). Both get the same KV cache bytes
(`--kv-cache-gib`, 4: vLLM's `VLLM_CPU_KVCACHE_SPACE`, our `--kv-cache-memory-bytes`).
Prints duration, out / total tok/s, TTFT and TPOT p50 / p99, and the ratio.
`vllm bench serve` is run through a wrapper that answers `importlib.metadata.version("vllm")`
with the vllm-cpu version + "+cpu" (../shared/peers/vllm-cpu.md). Without --vllm-python (or
when vllm does not import there) it says so and exits 0: there is no load generator.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request

from _peer import ours_env, vllm_env, vllm_importable  # benchmarks/ is sys.path[0]

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

_METRICS = (("duration", "duration s"), ("output_throughput", "out tok/s"),
            ("total_token_throughput", "total tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
            ("p99_ttft_ms", "TTFT p99 ms"), ("median_tpot_ms", "TPOT p50 ms"),
            ("p99_tpot_ms", "TPOT p99 ms"))


def _tail(path: str, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float, log: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy; "
                               f"the end of its log:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server on port {port} not healthy after {timeout_s} s")


def _bench(vllm_python: str, wrapper: str, port: int, name: str, args: argparse.Namespace,
           out_dir: str, tag: str, seed: int) -> dict:
    cmd = [vllm_python, wrapper, "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--model", name,
           "--tokenizer", args.model, "--dataset-name", "random",
           "--random-prefix-len", str(args.prefix_len), "--random-input-len",
           str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency",
           str(args.max_concurrency), "--ignore-eos", "--seed", str(seed), "--save-result",
           "--result-dir", out_dir, "--result-filename", f"{tag}.json"]
    proc = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, f"{tag}.json")) as f:
        return json.load(f)


def _engine_stats(port: int) -> dict:
    """Our server's /stats (cumulative engine counters)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=30) as r:
        stats: dict = json.load(r)
    return stats


def _serve(engine: str, args: argparse.Namespace, port: int, log: str) -> subprocess.Popen:
    if engine == "ours":
        env = ours_env()
        cmd = [sys.executable, "-m", "tokenspeed_jax.cli", "serve", "--model", args.model,
               "--dtype", args.dtype, "--max-context-len", "2048", "--port", str(port),
               "--served-model-name", "model", "--kv-cache-memory-bytes",
               f"{args.kv_cache_gib}G", *shlex.split(args.ours_args)]
    else:
        env = vllm_env(args.kv_cache_gib)
        cmd = [args.vllm_python, args.wrapper, "serve", args.model, "--dtype", args.dtype,
               "--max-model-len", "2048", "--max-num-seqs", "32", "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", "model"]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)


def main() -> None:
    from _machine import cpu_line  # benchmarks/ is sys.path[0] when run as a script

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint dir both load")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--engines", default="ours,vllm")
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--start-timeout-s", type=float, default=1800)
    p.add_argument("--warm-seed", type=int, default=1,
                   help="seed of the warm-up pass's prompts (the timed pass: 0)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache bytes of both servers")
    p.add_argument("--ours-args", default="",
                   help="more `tokenspeed-jax serve` flags, one shell-quoted string")
    args = p.parse_args()
    args.model = os.path.abspath(args.model)
    if not vllm_importable(args.vllm_python):
        print("vllm-cpu is not importable from --vllm-python: no load generator "
              "(../shared/peers/vllm-cpu.md says how to install it)")
        return
    results = {}
    with tempfile.TemporaryDirectory() as d:
        args.wrapper = os.path.join(d, "vllm_cli.py")
        with open(args.wrapper, "w") as f:
            f.write(_WRAPPER)
        for i, engine in enumerate(args.engines.split(",")):
            port = args.port + i
            log = os.path.join(d, f"{engine}-server.log")
            proc = _serve(engine, args, port, log)
            try:
                _wait_healthy(port, proc, args.start_timeout_s, log)
                _bench(args.vllm_python, args.wrapper, port, "model", args, d, f"{engine}-warm",
                       args.warm_seed)
                before = _engine_stats(port) if engine == "ours" else {}
                results[engine] = r = _bench(args.vllm_python, args.wrapper, port, "model", args,
                                             d, engine, 0)
                if before:
                    after = _engine_stats(port)
                    steps = after["num_engine_steps"] - before["num_engine_steps"]
                    print(f"ours: {steps} engine steps in the timed pass, "
                          f"{r['duration'] / max(steps, 1) * 1e3:.0f} ms per step; "
                          f"{after.get('host_ms_per_step', 0):.1f} ms host per step (whole run)",
                          flush=True)
                print(f"{engine}: " + ", ".join(f"{label} {r.get(key, float('nan')):.1f}"
                                               for key, label in _METRICS), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=120)
    print(f"\n## served vs vLLM CPU: {args.model}, {args.dtype}, {args.num_prompts} prompts of "
          f"{args.prefix_len} shared + {args.input_len} random tokens, {args.output_len} out, "
          f"concurrency {args.max_concurrency}, warm-up seed {args.warm_seed}, "
          f"{args.kv_cache_gib} GiB KV cache each"
          + (f", ours with `{args.ours_args}`" if args.ours_args else "")
          + f"\n\nCPU: {cpu_line()}\n")
    print("| server | " + " | ".join(label for _, label in _METRICS) + " |")
    print("|---|" + "---|" * len(_METRICS))
    for engine, r in results.items():
        print(f"| {engine} | " + " | ".join(f"{r.get(key, float('nan')):.1f}"
                                            for key, _ in _METRICS) + " |")
    if {"ours", "vllm"} <= results.keys():
        o, v = results["ours"], results["vllm"]
        print(f"\nours / vLLM out tok/s: {o['output_throughput'] / v['output_throughput']:.2f}x")


if __name__ == "__main__":
    main()
