"""Step 7: the table of every RESULT line in $OUT/results.jsonl, decode beside the roofline
(weight + KV bytes read per step over the read bandwidth step 4 measured), and each target of
issue 46 marked met or not."""

from __future__ import annotations

import json
import os

import common  # noqa: F401  (sys.path)
from common import OUT, result


def main() -> None:
    path = os.path.join(OUT, "results.jsonl")
    recs = []
    if os.path.exists(path):
        with open(path) as f:
            recs = [json.loads(line) for line in f]
    by = {}
    for r in recs:
        by.setdefault(r["step"], []).append(r)
    bw = by.get("4_bandwidth", [{}])[-1].get("read_gb_s")
    print(f"\n## device_e2e: {len(recs)} results; read bandwidth {bw and round(bw)} GB/s (step 4)")
    print("| rows | loop | ms/step | tok/s | roofline ms | % of roofline | plain-JAX dense ms |")
    print("|---|---|---|---|---|---|---|")
    dense = {r["rows"]: r["ms_per_step"] for r in by.get("4_dense_decode", [])}
    shares = {}
    for r in by.get("2_decode", []):
        roof = 1e3 * r["read_bytes_per_step"] / (bw * 1e9) if bw else None
        share = roof / r["ms_per_step"] if roof else None
        shares[(r["rows"], r["overlapped"])] = share
        print(
            f"| {r['rows']} | {'overlapped' if r['overlapped'] else 'sync'} | {r['ms_per_step']:.2f} | "
            f"{r['tok_s']:.0f} | {roof and f'{roof:.2f}'} | {share and f'{100 * share:.0f}%'} | "
            f"{dense.get(r['rows']) and round(dense[r['rows']], 2)} |"
        )
    cold = by.get("2_cold_start", [{}])[-1]
    warm = by.get("3_warm_start", [{}])[-1]
    hf = by.get("5_transformers", [{}])[-1]
    rows = sorted({k[0] for k in shares})
    top, one = (rows[-1], rows[0]) if rows else (None, None)
    over = next((r for r in by.get("2_decode", []) if r["rows"] == top and r["overlapped"]), {})
    # the device's idle gap between consecutive decode steps: what the host did not hide
    gap_ms = over.get("stats", {}).get("decode_critical_ms_per_step")
    targets = {
        "overlapped: device idle <= 10% of a decode step (most rows)": gap_ms is not None
        and gap_ms <= 0.1 * over["ms_per_step"],
        "decode at the most rows >= 70% of roofline": (shares.get((top, True)) or 0) >= 0.70,
        "batch 1 >= 80% of roofline": (shares.get((one, True)) or 0) >= 0.80,
        "cold start <= 120 s": cold.get("start_s", 1e9) <= 120,
        "warm start <= 20 s": warm.get("start_s", 1e9) <= 20,
        "greedy agreement >= 90%": hf.get("greedy_agreement", 0) >= 0.90,
        "mean |dlogprob| < 0.05": hf.get("mean_abs_dlogprob", 1) < 0.05,
        "no host copy of the model (peak RSS < param bytes)": cold.get("host_peak_rss_gb", 1e9) * 2**30
        < cold.get("param_bytes", 0),
    }
    for r in by.get("6_recurrent", []):
        fields = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("step", "kernel", "impl"))
        print(f"- {r['kernel']} chunk, {r['impl']}: {fields}")
    for name, ok in targets.items():
        print(f"- {'MET ' if ok else 'MISS'} {name}")
    shown = {f"{k[0]}{'o' if k[1] else 's'}": v for k, v in shares.items()}
    result("7_summary", read_gb_s=bw, shares=shown, targets=targets)


if __name__ == "__main__":
    main()
