"""`tokenspeed-jax bench serve`: online serving benchmark (like `vllm bench serve`).

Runs the agentic workload (`workloads.loadgen`) at several load levels, each a request rate
(sessions / s, Poisson or fixed-rate arrivals) or a concurrency cap, against `--url` or against
an in-process server built from the engine flags. Prints one table row per level, writes a JSON
result file and two PNG plots (matplotlib): latency vs load, and pages in use over time per cache
group (sampled from the server's /stats; skipped when the server has none).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
import threading
import time
from typing import Any

from tokenspeed_jax.cli.checks import float_at_least
from tokenspeed_jax.cli.common import (
    HelpFormatter,
    Parser,
    add_engine_args,
    add_workload_args,
    checked_llm,
    workload_config,
)
from tokenspeed_jax.workloads.loadgen import run_level, summarize


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tokenspeed-jax bench serve", formatter_class=HelpFormatter, description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--url",
        default=None,
        help="server to load (default: start one in process from the engine flags below)",
    )
    p.add_argument("--served-model-name", default=None, help="model id to send (default: --model)")
    p.add_argument(
        "--request-rates",
        default="2,8,inf",
        help="comma-separated session arrival rates per second ('inf' = all at once)",
    )
    p.add_argument(
        "--max-concurrency",
        default="64",
        help="comma-separated caps on requests in flight; each is run at every rate",
    )
    p.add_argument(
        "--arrival",
        choices=("poisson", "fixed"),
        default="poisson",
        help="inter-arrival times: exponential or constant",
    )
    add_workload_args(p, sessions=16, turns=3, system_tokens=256, sessions_help="sessions per level")
    p.add_argument(
        "--slo-ttft-ms", type=float_at_least(0.0), default=2000.0, help="goodput SLO on time to first token"
    )
    p.add_argument(
        "--slo-tpot-ms", type=float_at_least(0.0), default=200.0, help="goodput SLO on time per output token"
    )
    p.add_argument(
        "--result-dir", default="bench-serve-results", help="where the JSON result and the PNG plots go"
    )
    add_engine_args(p, num_pages=1024)
    return p


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"tokenspeed-jax bench serve: error: {name}: bad list {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"tokenspeed-jax bench serve: error: {name}: values must be > 0")
    return values


class _PageSampler:
    """Polls /stats every `period` s: (t, {group: pages in use}) over the whole benchmark."""

    def __init__(self, url: str, period: float = 0.1) -> None:
        self.url, self.period = url, period
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import httpx

        while not self._stop.is_set():
            try:
                st = httpx.get(f"{self.url}/stats", timeout=2).json()
                self.samples.append((time.perf_counter() - self.t0, dict(st["group_pages"])))
            except Exception:  # noqa: BLE001 - a server without /stats: no page plot
                return
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _plots(levels: list[dict], pages: list, marks: list[tuple[float, str]], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[str] = []

    def save(fig: Any, axes: Any, name: str) -> None:
        for ax in axes:
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = [lv["request_throughput"] for lv in levels]
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for q in ("p50", "p90", "p99"):
            ax.plot(x, [lv[f"{metric}_ms_{q}"] for lv in levels], marker="o", label=q)
        ax.set_xlabel("achieved throughput (requests / s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_title(f"{metric.upper()} vs load")
    save(fig, axes, "latency_vs_load.png")
    if pages:
        fig, ax = plt.subplots(figsize=(11, 4))
        groups = sorted({g for _, d in pages for g in d})
        for g in groups:
            ax.plot([t for t, _ in pages], [d.get(g, 0) for _, d in pages], label=g)
        for t, label in marks:
            ax.axvline(t, color="gray", ls=":", lw=1)
            ax.text(t, ax.get_ylim()[1] * 0.95, label, fontsize=7, rotation=90, va="top")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("pages in use")
        ax.set_title("pages in use per cache group (levels marked)")
        save(fig, [ax], "pages_over_time.png")
    return paths


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rates = _floats(args.request_rates, "--request-rates")
    caps = [int(c) for c in _floats(args.max_concurrency, "--max-concurrency")]
    model = args.served_model_name or args.model
    wl = workload_config(args)
    server = None
    url = args.url
    if url is None:
        from tokenspeed_jax.server.app import build_app, describe
        from tokenspeed_jax.server.thread import ServerThread

        llm, status = checked_llm(args, wl.longest_request)
        if llm is None:
            return status
        server = ServerThread(build_app(llm, model_name=model))
        t = time.perf_counter()
        server.wait_ready()
        print(
            f"in-process server: {describe(llm, model)} (warm-up {time.perf_counter() - t:.1f}s)", flush=True
        )
        url = server.url
        vocab = min(256, llm.model_config.vocab_size)
    else:
        url = url.rstrip("/")
        vocab = 256
    sampler = _PageSampler(url)
    levels, marks = [], []
    head = (
        f"{'rate':>6} {'conc':>5} {'done':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} "
        f"{'p99':>8} {'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'goodput':>8}"
    )
    print(head)
    try:
        for cap in caps:
            for rate in rates:
                marks.append((time.perf_counter() - sampler.t0, f"rate={rate:g} conc={cap}"))
                records, wall = asyncio.run(
                    run_level(
                        url, model, wl, rate=rate, vocab=vocab, max_concurrency=cap, arrival=args.arrival
                    )
                )
                lv = {
                    "request_rate": "inf" if math.isinf(rate) else rate,
                    "max_concurrency": cap,
                    **summarize(
                        records, wall, slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3
                    ),
                }
                levels.append(lv)
                fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
                print(
                    f"{rate:>6g} {cap:>5} {lv['completed']:>5} {lv['request_throughput']:>7.2f} "
                    f"{lv['output_throughput']:>9.1f} {fmt(lv['ttft_ms_p50']):>9} "
                    f"{fmt(lv['ttft_ms_p99']):>8} {fmt(lv['tpot_ms_p50']):>9} "
                    f"{fmt(lv['tpot_ms_p99']):>7} {fmt(lv['itl_ms_p50']):>8} "
                    f"{fmt(lv['itl_ms_p99']):>7} {lv['goodput']:>8.2f}",
                    flush=True,
                )
    finally:
        sampler.stop()
        if server is not None:
            server.stop()
    os.makedirs(args.result_dir, exist_ok=True)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "backend": "tokenspeed-jax" if args.url is None else "openai",
        "url": args.url,
        "model": model,
        "arrival": args.arrival,
        "workload": {**vars(wl), "vocab": vocab},
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "levels": levels,
        "pages_over_time": [{"t": round(t, 3), **d} for t, d in sampler.samples],
    }
    path = os.path.join(args.result_dir, "bench_serve.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plots = _plots(levels, sampler.samples, marks, args.result_dir)
    print(f"wrote {path} and {', '.join(plots)}")
    return 0 if all(lv["failed"] == 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
