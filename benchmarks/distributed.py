"""Multi-process overhead (issue 14): the same tp=4 model on 4 CPU devices, as ONE process with
4 virtual devices vs TWO processes with 2 each (gloo), measured side by side in one run.

    python benchmarks/distributed.py [--requests 8] [--max-tokens 32]

Columns: mean wall per engine step while serving (greedy decode-heavy batch, after warm-up),
and, for the two-process run, the leader's send of one step-sized message (NOOP messages through
the coordination service's key-value store: its cost of shipping StepOps to the followers) and
the host-side pack of one step.
Ratios only mean something side by side on the same machine; CPU gloo is not NCCL.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
SMALL = dict(
    page_size=16,
    num_pages=256,
    max_batch_requests=8,
    max_scheduled_tokens=64,
    max_context_len=256,
    attention_backend="reference",
)


def _serve(llm, n: int, max_tokens: int) -> dict:
    import numpy as np

    from tokenspeed_jax import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 24).tolist() for _ in range(n)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.warmup()
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    steps0 = sum(e.num_steps for e in llm.engines)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    steps = sum(e.num_steps for e in llm.engines) - steps0
    return {"step_ms": 1e3 * wall / steps, "steps": steps, "tokens": [o.token_ids for o in outs]}


def _worker(mode: str, pid: int, port: int, n: int, max_tokens: int) -> dict:
    sys.path.insert(0, ROOT)
    from tokenspeed_jax import LLM

    if mode == "single":
        return _serve(LLM("tiny-random", tensor_parallel_size=4, **SMALL), n, max_tokens)
    dist = dict(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    llm = LLM("tiny-random", tensor_parallel_size=4, distributed=dist, **SMALL)
    if pid:
        return {"steps": llm.run_follower()}
    out = _serve(llm, n, max_tokens)
    from scheduler import Scheduler
    from tokenspeed_jax.distributed.runner import NOOP, frame
    from tokenspeed_jax.runtime.shapes import StepShape
    from tokenspeed_jax.runtime.step_inputs import pack

    runner = llm.engine.runner  # the leader's DistributedRunner
    group = runner.group
    pad = Scheduler(llm.engine.scheduler.config).padding_ops()
    layout = runner.runner.step_layout(StepShape(16, 0))
    t0 = time.perf_counter()
    for _ in range(200):
        i32, f32 = pack(pad, layout)
        msg = frame(NOOP, 0, 0, 16, 0, i32, f32)
    out["pack_us"] = 1e6 * (time.perf_counter() - t0) / 200
    with group.lock:
        group.send(frame(NOOP, group.seq, 0, 16, 0, i32, f32))
        t0 = time.perf_counter()
        for _ in range(100):
            group.send(frame(NOOP, group.seq, 0, 16, 0, i32, f32))
        out["bcast_ms"] = 1e3 * (time.perf_counter() - t0) / 100
    out["bucket_words"] = int(msg.size)
    del runner
    llm.shutdown()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(devices: int, args: list[str]) -> subprocess.Popen:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
    )
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=900)
    if p.returncode:
        raise SystemExit(f"worker failed ({p.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    n, mt = str(a.requests), str(a.max_tokens)
    single = _result(_spawn(4, ["single", "0", "0", n, mt]))
    port = str(_free_port())
    procs = [_spawn(2, ["pair", str(i), port, n, mt]) for i in (1, 0)]
    try:
        leader = _result(procs[1])
        _result(procs[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    same = single["tokens"] == leader["tokens"]
    print(
        f"tiny-random tp=4 on 4 CPU devices, {a.requests} requests x {a.max_tokens} tokens "
        f"(greedy tokens identical: {same})"
    )
    print(f"{'setup':<34}{'steps':>7}{'ms/step':>10}")
    print(f"{'1 process x 4 devices':<34}{single['steps']:>7}{single['step_ms']:>10.2f}")
    print(f"{'2 processes x 2 devices (gloo)':<34}{leader['steps']:>7}{leader['step_ms']:>10.2f}")
    print(f"ratio 2-process / 1-process: {leader['step_ms'] / single['step_ms']:.2f}x")
    print(
        f"leader's send of one 16-token step ({leader['bucket_words']} words, coordination "
        f"key-value store): {leader['bcast_ms']:.3f} ms; pack of that step: {leader['pack_us']:.0f} us"
    )


if __name__ == "__main__":
    if "--worker" in sys.argv:
        mode, pid, port, n, mt = sys.argv[sys.argv.index("--worker") + 1 :][:5]
        print(json.dumps(_worker(mode, int(pid), int(port), int(n), int(mt))))
    else:
        main()
