"""The host KV tier (issue 49): recompute saved and throughput won when the device pool is small.

    python benchmarks/kv_tier.py            # SmolLM2-135M (f32), 3 interleaved reps
    python benchmarks/kv_tier.py --quick    # the built-in tiny model, 1 rep (a smoke run)

1. agentic: sessions sharing a system prompt, each turn resending its whole history
   (`workloads.agentic`). A roomy run measures the working set (the pages the workload caches in a
   pool that evicts nothing); then the device pool is cut to `--agentic-pool` (25%) of it and the same
   workload runs without and with the tier (`kv_offloading_size` big enough for the working
   set). Targets: computed prefill tokens <= 0.5x, output throughput >= 1.3x, same tokens.
2. retraction: `--batch` requests of random prompts sent at once; the pool at `--retract-pool`
   (40%) of the roomy run's peak, so requests are retracted and resume. Target: >= 1.2x.
3. transfer cost per page: the tier's copy time per page moved (the runner's `host_copy_s`:
   numpy gather, the copy program, writing saves back) beside the recompute time per page
   (computed-token rate of the run without the tier x page size), and what the same page
   costs on a GPU: bytes over PCIe / NVLink-C2C vs its recompute FLOPs, for this model and an
   8B one.
Each configuration is one `LLM` built once (shapes compiled before timing); reps interleave the
configurations, and every rep starts from an empty prefix cache (`reset_prefix_cache`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from benchmarks._machine import cpu_line  # noqa: E402

GiB = 1 << 30


def _llm(model: str, num_pages: int, tier_gib: float, args: argparse.Namespace):
    from tokenspeed_jax import LLM

    llm = LLM(
        model,
        num_pages=num_pages,
        page_size=args.page_size,
        max_batch_requests=args.max_batch_requests,
        max_scheduled_tokens=args.max_scheduled_tokens,
        max_context_len=args.max_context_len,
        kv_offloading_size=tier_gib,
    )
    llm.warmup()
    return llm


def _reset(llm) -> None:
    llm.engine.scheduler.reset_prefix_cache()


def _agentic(llm, cfg) -> tuple[dict, dict, list]:
    from tokenspeed_jax.workloads.agentic import run_workload

    _reset(llm)
    before = dict(llm.engine.stats())
    outs: list = []
    engine = llm.engine
    orig = engine._output

    def keep(rid, track, token_ids, reason):  # every output's tokens, by request id
        outs.append((rid, list(token_ids)))
        return orig(rid, track, token_ids, reason)

    engine._output = keep
    try:
        report = run_workload(engine, cfg, vocab=llm.model_config.vocab_size).summary()
    finally:
        engine._output = orig
    after = llm.engine.stats()
    delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    return report, delta, sorted(outs)


def _batch(llm, prompts, max_tokens: int) -> tuple[float, dict, list]:
    import time

    from tokenspeed_jax import SamplingParams

    _reset(llm)
    before = dict(llm.engine.stats())
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    after = llm.engine.stats()
    delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return sum(len(o.token_ids) for o in outs) / wall, delta, [o.token_ids for o in outs]


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true", help="tiny model, small workload, 1 rep")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", choices=("agentic", "retraction"), help="run one workload (default: both)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-batch-requests", type=int, default=8)
    p.add_argument("--max-scheduled-tokens", type=int, default=512)
    p.add_argument("--max-context-len", type=int, default=1024)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--agentic-pool", type=float, default=0.25)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=96)
    p.add_argument("--retract-pool", type=float, default=0.4)
    args = p.parse_args()
    if args.quick:
        args.model, args.reps = "tiny-random", 1
        args.sessions, args.turns, args.system_tokens, args.user_tokens = 12, 3, 64, 24
        args.batch, args.prompt_len, args.gen_len, args.max_context_len = 6, 64, 32, 512

    from tokenspeed_jax.workloads.agentic import WorkloadConfig

    cfg = WorkloadConfig(
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        max_tokens=args.max_tokens,
    )
    print(f"# machine: {cpu_line()}")
    print(
        f"# model {args.model}, page {args.page_size}, "
        f"{args.max_batch_requests} rows x {args.max_scheduled_tokens} tokens a step"
    )

    copy_s, moved, recompute_page_s, pb = 0.0, 0, 0.0, 0
    if args.only != "retraction":
        copy_s, moved, recompute_page_s, pb = _agentic_section(args, cfg)
    if args.only != "agentic":
        pb = _retraction_section(args)
    # ---- 3. transfer cost
    print(
        f"\n## transfer cost per page ({pb / 1024:.0f} KiB: every layer's K and V of {args.page_size} tokens)"
    )
    if moved:
        rate = pb * moved / max(copy_s, 1e-9) / GiB
        print(
            f"host tier copies on this CPU: {copy_s / moved * 1e3:.3f} ms a page ({moved} pages moved, "
            f"{rate:.2f} GiB/s); recompute: {recompute_page_s * 1e3:.2f} ms a page "
            f"({args.page_size} tokens at the no-tier run's computed-token rate)"
        )
    _gpu_prediction(args, pb)


def _agentic_section(args: argparse.Namespace, cfg) -> tuple[float, int, float, int]:
    """Section 1; returns (copy seconds, pages moved, recompute seconds a page, page bytes)."""
    roomy = _llm(args.model, 4096, 0.0, args)
    _, _, want = _agentic(roomy, cfg)
    # the working set: every page the workload cached (nothing was evicted from the roomy pool)
    pool = roomy.engine.scheduler.pool
    working = sum(1 for p in range(1, pool.num_pages) if pool.key_of(p) is not None)
    working = max(working, pool.peak_used)
    pb = _page_bytes(roomy)
    # at least what the longest request pins alone (else it could never run)
    need = roomy.engine.scheduler.coord.solo_peak_pages(cfg.longest_request, args.max_scheduled_tokens)
    del roomy
    pages = max(int(working * args.agentic_pool), need)
    tier_gib = 2 * working * pb / GiB
    print(
        f"\n## agentic: {cfg}\nworking set {working} cached pages; device pool {pages} pages "
        f"({args.agentic_pool:.0%}), host tier {tier_gib:.3f} GiB"
    )
    engines = {
        "no tier": _llm(args.model, pages + 1, 0.0, args),
        "host tier": _llm(args.model, pages + 1, tier_gib, args),
    }
    runs: dict[str, list] = {k: [] for k in engines}
    for _ in range(args.reps):
        for name, llm in engines.items():
            runs[name].append(_agentic(llm, cfg))
    _table_agentic(runs, want)
    host = runs["host tier"][-1][1]
    copy_s = host.get("host_copy_s", 0.0)
    moved = host.get("host_pages_saved", 0) + host.get("host_pages_loaded", 0)
    base = runs["no tier"][-1][0]
    recompute_page_s = args.page_size / base["computed_tok_per_s"]
    return copy_s, moved, recompute_page_s, pb


def _retraction_section(args: argparse.Namespace) -> int:
    """Section 2; returns the page bytes."""
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(3, 20000 if not args.quick else 250, args.prompt_len).tolist() for _ in range(args.batch)
    ]
    roomy = _llm(args.model, 4096, 0.0, args)
    roomy.engine.scheduler.pool.reset_peak()
    _, _, want_b = _batch(roomy, prompts, args.gen_len)
    peak = roomy.engine.scheduler.pool.peak_used
    need = roomy.engine.scheduler.coord.solo_peak_pages(
        args.prompt_len + args.gen_len, args.max_scheduled_tokens
    )
    pb = _page_bytes(roomy)
    del roomy
    pages = max(int(peak * args.retract_pool), need)
    print(
        f"\n## retraction: {args.batch} x ({args.prompt_len} + {args.gen_len}) at once; peak {peak} pages, "
        f"device pool {pages} ({args.retract_pool:.0%})"
    )
    engines = {
        "no tier": _llm(args.model, pages + 1, 0.0, args),
        "host tier": _llm(args.model, pages + 1, 2 * peak * pb / GiB, args),
    }
    runs = {k: [] for k in engines}
    for _ in range(args.reps):
        for name, llm in engines.items():
            runs[name].append(_batch(llm, prompts, args.gen_len))
    print("| engine | out tok/s | retractions | resume hit tokens | computed prefill tokens | same tokens |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        d = rs[-1][1]
        print(
            f"| {name} | {_med([r[0] for r in rs])} | {d['num_retractions']} | {d['resume_hit_tokens']} | "
            f"{d['num_prefill_tokens']} | {all(r[2] == want_b for r in rs)} |"
        )
    ratio = statistics.median(r[0] for r in runs["host tier"]) / statistics.median(
        r[0] for r in runs["no tier"]
    )
    print(f"throughput with / without the tier: {ratio:.2f}x (target >= 1.2x)")

    return pb


def _page_bytes(llm) -> int:
    """Device bytes of one page id (every layer's pools), as the host tier sizes its pages."""
    from tokenspeed_jax.runtime.state import bytes_per_page

    r = llm.engine.runner
    return bytes_per_page(r.config, r.layout.layer_groups, r.layout.page_sizes, r.kv_cache_dtype)


def _gpu_prediction(args: argparse.Namespace, page_bytes_f32: int) -> None:
    """A page's load time over a host link vs its recompute time on an H100, for this model in
    bf16 and for an 8B Llama (32 layers, 8 KV heads of 128, bf16)."""
    links = {"PCIe 5 x16 pinned (~50 GB/s)": 50e9, "NVLink-C2C GH200 (~450 GB/s)": 450e9}
    flops = 989e12 * 0.5  # H100 bf16 dense peak at 50% MFU for prefill
    models = {
        f"{args.model} bf16": (page_bytes_f32 // 2, 2 * 135e6),
        "Llama-3-8B bf16": (32 * 2 * 8 * 128 * 2 * args.page_size, 2 * 8e9),
    }
    print("\n| model (GPU prediction) | page bytes | recompute on H100 | " + " | ".join(links) + " |")
    print("|---|---|---|" + "---|" * len(links))
    for name, (pb, fl_tok) in models.items():
        rec = fl_tok * args.page_size / flops
        cells = " | ".join(f"{pb / bw * 1e6:.1f} us ({rec / (pb / bw):.1f}x faster)" for bw in links.values())
        print(f"| {name} | {pb / 1024:.0f} KiB | {rec * 1e6:.1f} us | {cells} |")


def _table_agentic(runs: dict[str, list], want: list) -> None:
    print(
        "| engine | out tok/s | TTFT p50 ms | computed prefill tokens | prefix hit rate "
        "| host hit tokens | pages saved / loaded | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        rep, d, _ = rs[-1]
        thr, ttft = _med([r[0]["output_tok_per_s"] for r in rs]), _med([r[0]["ttft_ms_p50"] for r in rs])
        print(
            f"| {name} | {thr} | {ttft} | {rep['computed_prompt_tokens']} | {rep['prefix_hit_rate']} "
            f"| {d.get('host_hit_tokens', 0)} | {d.get('host_pages_saved', 0)} / "
            f"{d.get('host_pages_loaded', 0)} | {all(r[2] == want for r in rs)} |"
        )
    a, b = runs["no tier"], runs["host tier"]
    comp = b[-1][0]["computed_prompt_tokens"] / max(1, a[-1][0]["computed_prompt_tokens"])
    thr = statistics.median(r[0]["output_tok_per_s"] for r in b) / statistics.median(
        r[0]["output_tok_per_s"] for r in a
    )
    print(
        f"computed prefill with / without the tier: {comp:.2f}x (target <= 0.5x); "
        f"throughput {thr:.2f}x (target >= 1.3x)"
    )


if __name__ == "__main__":
    main()
