"""Host microseconds of `Scheduler.schedule()` / `update()` on all-decode steps (issue 12), no model.

    PYTHONPATH=. python benchmarks/decode_host.py [--rows 32] [--reps 6]

`rows` requests (prompt 400, 200 output tokens, page 16, roomy pool) are prefilled, then decode
together; the sampled ids are a constant (no stop token). Timed: the steps whose rows are all
one-token decodes; a new page every 16 tokens per request, staggered, so most steps have a row
or two that takes a page. Per mode and loop (synchronous, or planned one step ahead as the
overlapped engine does) the median over the decode steps of the best repetition is printed;
"general" = `decode_fast_path=False` (every row through reclaim -> acquire -> `OpsBuilder.build`),
"fast" = the decode fast path (plain rows + the vectorised `OpsBuilder.build_decode`).
`--waiting K` queues K more requests behind the full batch (timed: steps with a queue).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402

from scheduler import Scheduler, SchedulerConfig  # noqa: E402


def run(rows: int, ahead: bool, fast: bool, reps: int, waiting: int) -> tuple[float, float, int]:
    best: tuple[float, float, int] | None = None
    for _ in range(reps):
        cfg = SchedulerConfig(
            num_pages=4096,
            page_size=16,
            max_batch_requests=rows,
            max_scheduled_tokens=512,
            max_context_len=2048,
        )
        s = Scheduler(cfg)
        s.decode_fast_path = fast
        rng = np.random.default_rng(0)
        for i in range(rows + waiting):
            s.add_request(f"r{i}", rng.integers(4, 200, 400).tolist(), 200, stop_token_ids=[1])
        tok = np.full(rows, 7, np.int32)
        ts: list[float] = []
        tu: list[float] = []
        prev = None
        while s.has_unfinished() or prev is not None:
            t0 = time.perf_counter()
            ops = s.schedule()
            t1 = time.perf_counter()
            decode = ops.num_seqs == rows and ops.num_tokens == rows
            if waiting and not s._waiting:
                decode = False  # time only the steps that have a queue behind the full batch
            done, prev = (prev, ops if ops.num_seqs else None) if ahead else (ops, None)
            t2 = time.perf_counter()
            if done is not None:
                s.update(done, tok)
            t3 = time.perf_counter()
            if decode:
                ts.append(t1 - t0)
                tu.append(t3 - t2)
        r = (float(np.median(ts)) * 1e6, float(np.median(tu)) * 1e6, len(ts))
        best = r if best is None or r[0] + r[1] < best[0] + best[1] else best
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument(
        "--waiting",
        type=int,
        default=0,
        help="extra requests queued behind the full batch (as in the engine workload)",
    )
    args = ap.parse_args(argv)
    print(
        f"| loop | path | schedule us | update us | decode steps |  ({args.rows} rows, "
        f"{args.waiting} waiting)"
    )
    print("|---|---|---|---|---|")
    for ahead in (False, True):
        for fast in (False, True):
            sch, upd, n = run(args.rows, ahead, fast, args.reps, args.waiting)
            print(
                f"| {'ahead' if ahead else 'sync'} | {'fast' if fast else 'general'} | "
                f"{sch:.1f} | {upd:.1f} | {n} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
