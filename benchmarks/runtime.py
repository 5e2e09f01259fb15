"""Runtime benchmark (issue 4): page-table update cost vs context, compiles, end-to-end tokens/s.

    python benchmarks/runtime.py            # full (a few minutes on 2 CPU cores)
    python benchmarks/runtime.py --quick    # smoke

1. Page-table update per pure-decode step, 256 decoding requests, 4k vs 128k context (page 16):
   the jitted `update_rows` including the host->device transfer of the step's group ops.
   "rows sent" transfers the i32[R, W] refresh rows every step; "rows elided" reuses a resident
   device zero array when no row refreshes (what the runner does).
2. Compilations over 1,000 steps of a varied workload (mixed prefill/decode, arrivals, finishes):
   at most one per (token bucket, kv bucket) shape key, none once every key has been met.
3. End-to-end tokens/s of the main job (`tokenspeed-jax run`'s workload).
4. StepOps host->device per step (issue 11): a real decode StepOps (48 decoding requests, 450
   tokens each, max_context_len 4096, page 16) moved the old way (`jax.device_put` of a dict of
   every field array, group rows elided on pure-decode steps) vs the schema-driven packing
   (`step_inputs.pack` into one i32 + one f32 buffer, cut to the step's token and kv buckets,
   two transfers). Both timed until the arrays are ready on the device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# `python benchmarks/runtime.py` puts benchmarks/ first on sys.path, where scheduler.py (the
# scheduler benchmark) would shadow the `scheduler` package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tokenspeed_jax.page_table import update_rows  # noqa: E402


def _decode_ops(rng, r: int, width: int, delta: int, step: int):
    """One pure-decode step's group ops: every 16th request crosses a page boundary."""
    slots = np.arange(r, dtype=np.int32)
    sizes = ((slots + step) % 16 == 0).astype(np.int32)
    begins = np.full(r, width // 2, np.int32)
    new_pages = np.zeros((r, delta), np.int32)
    new_pages[:, 0] = rng.integers(1, 1 << 20, r)
    return dict(
        req_slots=slots,
        begins=begins,
        sizes=sizes,
        new_pages=new_pages,
        full_refresh=np.zeros(r, bool),
        row_lens=np.zeros(r, np.int32),
        hole_slots=np.full((r, delta), width, np.int32),
    )


def bench_page_table(contexts=(4096, 131072), r=256, page=16, steps=200) -> list[dict]:
    rng = np.random.default_rng(0)
    fn = jax.jit(
        update_rows.__wrapped__ if hasattr(update_rows, "__wrapped__") else update_rows, donate_argnums=(0,)
    )
    out = []
    for ctx in contexts:
        width, delta = ctx // page, 2
        for mode in ("rows sent", "rows elided"):
            table = jnp.zeros((r, width), jnp.int32)
            resident_rows = jnp.zeros((r, width), jnp.int32)
            times = []
            for step in range(steps + 10):
                ops = _decode_ops(rng, r, width, delta, step)
                t0 = time.perf_counter()
                dev = jax.device_put(ops)
                rows = (
                    jax.device_put(np.zeros((r, width), np.int32)) if mode == "rows sent" else resident_rows
                )
                table = fn(
                    table,
                    dev["req_slots"],
                    dev["begins"],
                    dev["sizes"],
                    dev["new_pages"],
                    dev["full_refresh"],
                    rows,
                    dev["row_lens"],
                    hole_slots=dev["hole_slots"],
                )
                table.block_until_ready()
                if step >= 10:
                    times.append(time.perf_counter() - t0)
            out.append(dict(context=ctx, width=width, mode=mode, median_us=statistics.median(times) * 1e6))
    return out


def bench_compiles(steps: int = 1000, seed: int = 0) -> dict:
    from tokenspeed_jax import LLM, SamplingParams

    llm = LLM(
        "tiny-random",
        num_pages=600,
        page_size=16,
        max_batch_requests=16,
        max_scheduled_tokens=256,
        max_context_len=512,
    )
    engine, rng = llm.engine, np.random.default_rng(seed)
    runner = engine.runner
    warm_steps, compiles_after_warmup, n = 0, None, 0
    t0 = time.perf_counter()
    for step in range(steps):
        if rng.random() < 0.3 or not engine.has_unfinished():
            plen = int(rng.choice([3, 17, 60, 150, 300]))
            engine.add_request(
                rng.integers(0, 256, plen).tolist(),
                SamplingParams(max_tokens=int(rng.integers(1, 40)), ignore_eos=True),
                request_id=f"v{n}",
            )
            n += 1
        engine.step()
        if compiles_after_warmup is None and runner.num_compiles == len(runner.shape_keys):
            compiles_after_warmup, warm_steps = runner.num_compiles, step + 1
    return dict(
        steps=steps,
        requests=n,
        buckets=len(runner.shape_keys),
        compiles=runner.num_compiles,
        all_buckets_warm_at_step=warm_steps,
        wall_s=time.perf_counter() - t0,
    )


def bench_e2e(quick: bool) -> dict:
    from tokenspeed_jax import LLM
    from tokenspeed_jax.workloads.agentic import WorkloadConfig, run_workload

    llm = LLM("tiny-random", num_pages=1024, page_size=16, max_batch_requests=32, max_scheduled_tokens=512)
    wl = WorkloadConfig(sessions=8 if quick else 24, turns=2 if quick else 3)
    llm.warmup()  # compile every token bucket first: the timed run measures serving only
    return run_workload(llm.engine, wl).summary()


def _decode_step_ops(requests: int = 48, prompt: int = 450, ctx: int = 4096):
    from scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(
        SchedulerConfig(
            num_pages=4096,
            page_size=16,
            max_batch_requests=64,
            max_scheduled_tokens=2048,
            max_context_len=ctx,
        )
    )
    rng = np.random.default_rng(0)
    for i in range(requests):
        sched.add_request(f"r{i}", rng.integers(0, 1000, prompt).tolist(), 64)
    ops = sched.schedule()
    while ops.num_tokens != ops.num_seqs or ops.full_refresh.any():  # until a pure decode step
        sched.update(ops, np.ones(64, np.int32))
        ops = sched.schedule()
    return ops


def bench_step_inputs(steps: int = 300) -> dict:
    """Median us per step: old dict-of-arrays transfer vs the packed schema-driven one."""
    from scheduler.step_ops import GroupStepOps, StepOps, device_schema
    from tokenspeed_jax.runtime.shapes import kv_levels
    from tokenspeed_jax.runtime.step_inputs import layout_for, pack

    ops = _decode_step_ops()
    bucket = 64  # token bucket of a 48-row decode step
    widths = tuple(g.rows.shape[1] for g in ops.groups)
    deltas = tuple(g.new_pages.shape[1] for g in ops.groups)
    need = int(ops.kv_lens.max())
    cols = next(c for t, c in kv_levels(widths, (16,) * len(widths), 256) if t >= need)

    def old():  # what the runner did before: one array per field, rows elided without refresh
        d = {
            n: np.asarray(getattr(ops, n))[:bucket] if a == "token" else np.asarray(getattr(ops, n))
            for n, a, _ in device_schema(StepOps)
        }
        d["groups"] = [
            {n: np.asarray(getattr(g, n)) for n, _, _ in device_schema(GroupStepOps) if n != "rows"}
            for g in ops.groups
        ]
        return jax.device_put(d)

    layout = layout_for(64, bucket, deltas, cols)

    def new():
        return jax.device_put(pack(ops, layout))

    out = {}
    for name, fn in (("dict of arrays (before)", old), ("packed i32 + f32 (after)", new)):
        times = []
        for i in range(steps + 20):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            if i >= 20:
                times.append(time.perf_counter() - t0)
        leaves = len(jax.tree_util.tree_leaves(fn()))
        out[name] = (statistics.median(times) * 1e6, leaves)
    t0 = time.perf_counter()
    for _ in range(steps):
        pack(ops, layout)
    out["pack only"] = ((time.perf_counter() - t0) / steps * 1e6, 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    rows = bench_page_table(steps=30 if args.quick else 200)
    print("\n## Page-table update per pure-decode step (256 requests, page 16)\n")
    print("| context | mirror width | mode | median us/step |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['width']} | {r['mode']} | {r['median_us']:.0f} |")
    for mode in ("rows sent", "rows elided"):
        a, b = (r["median_us"] for r in rows if r["mode"] == mode)
        print(f"\n128k/4k ratio ({mode}): {b / a:.2f}")
    c = bench_compiles(steps=150 if args.quick else 1000)
    print("\n## Compilations over a varied workload\n")
    print("| steps | requests | (token, kv) shape keys | compiles | all keys compiled by step | wall s |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {c['steps']} | {c['requests']} | {c['buckets']} | {c['compiles']} | "
        f"{c['all_buckets_warm_at_step'] or 'n/a'} | {c['wall_s']:.1f} |"
    )
    print("\n## StepOps host->device per decode step (48 rows, 450 tokens, context 4096)\n")
    print("| transfer | arrays | median us/step |")
    print("|---|---|---|")
    for name, (us, leaves) in bench_step_inputs(steps=60 if args.quick else 300).items():
        print(f"| {name} | {leaves or '-'} | {us:.0f} |")
    e = bench_e2e(args.quick)
    print("\n## End to end: the main job's workload (after `llm.warmup()` compiled every bucket)\n")
    print(
        "| requests | generated | computed prompt | wall s | output tok/s | computed tok/s | "
        "TTFT p50 ms | TPOT p50 ms | prefix hit rate |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {e['requests']} | {e['generated_tokens']} | {e['computed_prompt_tokens']} | "
        f"{e['wall_s']} | {e['output_tok_per_s']} | {e['computed_tok_per_s']} | "
        f"{e['ttft_ms_p50']} | {e['tpot_ms_p50']} | {e['prefix_hit_rate']} |"
    )


if __name__ == "__main__":
    main()
