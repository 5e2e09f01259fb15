"""Host time per part of the engine loop (issue 12), sync and async, on `overlap.py`'s workload.

    PYTHONPATH=. python benchmarks/overlap_profile.py [--modes sync,async] [--cprofile async]

Wraps (timing only, behaviour unchanged) Scheduler.schedule / update, step_inputs.pack, the
jitted step call (ModelRunner.execute), ModelRunner.dispatch / collect and the engine's logprob
routing / output building, runs the workload once per mode on one warmed-up engine, and prints
ms per dispatched step for each part (all steps, and decode steps only: every row a one-token
decode; a part that takes no StepOps counts for the step last scheduled or dispatched) plus the
StepClock figures and the device-idle gaps by step kind.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402

import tokenspeed_jax.runtime.runner as runner_mod  # noqa: E402
from scheduler import Scheduler, StepOps  # noqa: E402
from tokenspeed_jax import LLM  # noqa: E402
from tokenspeed_jax.workloads.agentic import WorkloadConfig, run_workload  # noqa: E402

PARTS = (
    "schedule",
    "pack",
    "jit_call",
    "dispatch_total",
    "collect",
    "update",
    "route_logprobs",
    "output",
    "engine_step",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--cprofile", default="", help="mode to run under cProfile (top 30 printed)")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args(argv)
    acc: collections.defaultdict[str, float] = collections.defaultdict(float)
    dec: collections.defaultdict[str, float] = collections.defaultdict(float)  # decode steps only
    kind = [False]  # whether the StepOps being handled is all one-token decodes

    def wrap(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            ops = next((x for x in a if isinstance(x, StepOps)), None)
            if ops is not None:  # parts called without a StepOps count for the last one seen
                kind[0] = ops.num_seqs > 0 and ops.num_tokens == ops.num_seqs
            t = time.perf_counter()
            out = None
            try:
                out = f(*a, **k)
                return out
            finally:
                dt = time.perf_counter() - t
                acc[key] += dt
                if isinstance(out, StepOps):  # schedule: its result tells the kind
                    kind[0] = out.num_seqs > 0 and out.num_tokens == out.num_seqs
                if kind[0]:
                    dec[key] += dt
                    dec["n_" + key] += 1

        setattr(obj, name, timed)

    wl = WorkloadConfig(
        sessions=args.sessions, turns=args.turns, system_tokens=384, user_tokens=24, max_tokens=24
    )
    llm = LLM("tiny-random", page_size=16, num_pages=1024, max_batch_requests=32, max_scheduled_tokens=512)
    llm.warmup()
    eng = llm.engine
    runner = eng.runner
    wrap(runner_mod, "pack", "pack")
    for obj, name, key in (
        (runner, "execute", "jit_call"),
        (runner, "dispatch", "dispatch_total"),
        (runner, "collect", "collect"),
        (eng, "_route_logprobs", "route_logprobs"),
        (eng, "_output", "output"),
        (eng, "step", "engine_step"),
    ):
        wrap(obj, name, key)
    for mode in args.modes.split(","):
        eng.drain()
        eng.async_scheduling = mode == "async"
        eng.scheduler = Scheduler(eng.scheduler.config)
        wrap(eng.scheduler, "schedule", "schedule")
        wrap(eng.scheduler, "update", "update")
        acc.clear()
        dec.clear()
        eng.clock.reset()
        prof = cProfile.Profile() if args.cprofile == mode else None
        if prof is not None:
            prof.enable()
        rep = run_workload(eng, wl, vocab=256)
        if prof is not None:
            prof.disable()
        eng.drain()
        clock, n = eng.clock, max(eng.clock.num_steps, 1)
        s = clock.summary()
        print(
            f"== {mode}: {rep.summary()['output_tok_per_s']} out tok/s, {clock.num_steps} steps, "
            f"host {s['host_ms_per_step']:.2f} ms/step, decode host "
            f"{s['decode_host_ms_per_step']:.2f}, decode critical "
            f"{s['decode_critical_ms_per_step']:.3f}, wait {s['wait_ms_per_step']:.2f}"
        )
        nd = max(int(dec["n_dispatch_total"]), 1)
        print(f"  {'part':16s} {'ms/step':>8s} {'ms/decode step':>15s}  ({nd} decode steps)")
        for k in PARTS:
            print(f"  {k:16s} {1e3 * acc[k] / n:8.3f} {1e3 * dec[k] / nd:15.3f}")
        for label, decode in (("decode", True), ("other", False)):
            xs = [g for d, _, g in clock.gaps if d == decode]
            if xs:
                print(
                    f"  gaps {label:7s} n={len(xs)} nonzero={sum(x > 0 for x in xs)} "
                    f"mean={1e3 * np.mean(xs):.3f} ms max={1e3 * max(xs):.2f} ms"
                )
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
