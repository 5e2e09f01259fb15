"""Scheduler benchmark (issue 3): our `Scheduler` vs TokenSpeed's C++ scheduler, same run.

Host microseconds per scheduler step, no model: sampled tokens are random ids from a seeded
numpy RNG. One step is
  ours:   schedule() (incl. building the fixed-shape StepOps) + update(ops, sampled)
  theirs: next_execution_plan() + reading the plan as a runtime would (rows, lengths, token
          ids, block_tables_arrays, pages to zero/copy) + building and feeding the
          ExecutionEvent (one ExtendResult per row, Finish, cache-op acks) + advance()
Workloads (page 16, token budget 8192, max batch >= requests, same pool size for both):
  a  256 concurrent decodes, prompt 512, 256 out
  b  1024 concurrent decodes, prompt 512, 256 out
  c  256 requests sharing a 2048-token prefix (+64 own tokens), 128 out
  d  memory pressure: 128 x (256 prompt + 512 out), pool ~42% of peak (retraction)
  e  full + sliding(128) groups, 32 requests, prompt 128, 8192 out
  ctx per-step cost vs context: 16 requests decoding at 4k vs at 128k context (same config)
Both schedulers run each workload in the same pass in lockstep (one step of ours, one step of
theirs, ...), so load from other processes on the machine lands on both alike; a workload's
numbers per scheduler come from its best pass (lowest median step time). `sum s` is the sum of
the timed steps (the whole workload's host scheduling time).

    python benchmarks/scheduler.py                 # full run (several minutes)
    python benchmarks/scheduler.py --quick         # smoke run (scaled-down workloads)
    python benchmarks/scheduler.py --only a,c --passes 5
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import platform
import sys
import time
from pathlib import Path

import numpy as np

# Run as a script, this file's folder is sys.path[0] and this file would shadow the `scheduler`
# package: drop the folder, and load the peer driver beside it by path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if sys.modules.get("scheduler") is sys.modules.get("__main__"):
    sys.modules.pop("scheduler", None)

from scheduler import PagedCacheGroupSpec, Scheduler, SchedulerConfig  # noqa: E402

_spec = importlib.util.spec_from_file_location("_peer_tokenspeed", _HERE / "_peer_tokenspeed.py")
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)

PAGE = 16
BUDGET = 8192
VOCAB = 32000


@dataclasses.dataclass
class Workload:
    key: str
    desc: str
    num_reqs: int
    prompt: int  # own (random) prompt tokens per request
    out: int  # generated tokens per request
    num_pages: int  # pool size incl. the null page (same for both schedulers)
    shared_prefix: int = 0  # identical leading tokens of every prompt
    sliding_window: int | None = None  # adds a sliding group beside the full one
    snapshot_images: int = 0  # TokenSpeed retraction images (0 = no snapshot pool)
    max_context_len: int | None = None
    decode_only: bool = False  # ctx: only pure decode steps count
    measure_steps: int = 0  # ctx: timed steps after every request reached decode (then stop)

    @property
    def context(self) -> int:
        return self.shared_prefix + self.prompt + self.out

    def prompts(self, seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        shared = rng.integers(1, VOCAB, size=self.shared_prefix).tolist()
        return [shared + rng.integers(1, VOCAB, size=self.prompt).tolist() for _ in range(self.num_reqs)]


def _peak_pages(n: int, tokens: int) -> int:
    return n * -(-tokens // PAGE)


def workloads(quick: bool) -> list[Workload]:
    q = 4 if quick else 1  # --quick: fewer requests / shorter outputs
    ws = [
        Workload("a", f"{256 // q} decodes, prompt 512, {256 // q} out", 256 // q, 512, 256 // q, 12864 // q),
        Workload(
            "b", f"{1024 // q} decodes, prompt 512, {256 // q} out", 1024 // q, 512, 256 // q, 51264 // q
        ),
        Workload(
            "c",
            f"{256 // q} x (2048 shared + 64), {128 // q} out",
            256 // q,
            64,
            128 // q,
            3776,
            shared_prefix=2048,
        ),
        Workload(
            "d",
            f"{128 // q} x (256 + {512 // q}), pool ~42% of peak",
            128 // q,
            256,
            512 // q,
            int(0.42 * _peak_pages(128 // q, 256 + 512 // q)) + 1,
            snapshot_images=64 // q,
        ),
        Workload(
            "e",
            f"{32 // q} x full+swa(128), prompt 128, {8192 // q} out",
            32 // q,
            128,
            8192 // q,
            18368 // q,
            sliding_window=128,
        ),
    ]
    # Context test: n requests prefill a (ctx - 16)-token prompt, then `measure` decode steps
    # with all n rows decoding are timed. `out` leaves room for the tokens the first requests
    # decode while the later ones still prefill (128k: 16 chunks per request).
    n, measure, out = (4, 64, 256) if quick else (16, 256, 1024)
    for ctx in (4096, 131072):
        ws.append(
            Workload(
                f"ctx{ctx // 1024}k",
                f"{n} decodes at {ctx // 1024}k context",
                n,
                ctx - 16,
                out,
                _peak_pages(n, ctx + out) + n + 64,
                max_context_len=131072 + 1024,
                decode_only=True,
                measure_steps=measure,
            )
        )
    return ws


# ---------------------------------------------------------------------- runners
class OursRunner:
    def __init__(self, w: Workload) -> None:
        groups = [PagedCacheGroupSpec.make("full", "full_history", page_size=PAGE)]
        if w.sliding_window:
            groups.append(
                PagedCacheGroupSpec.make(
                    "swa", "sliding_window", page_size=PAGE, sliding_window_tokens=w.sliding_window
                )
            )
        self.sched = Scheduler(
            SchedulerConfig(
                num_pages=w.num_pages,
                page_size=PAGE,
                max_batch_requests=w.num_reqs,
                max_scheduled_tokens=BUDGET,
                max_context_len=w.max_context_len or w.context,
                groups=groups,
            )
        )
        self.R = w.num_reqs
        self.last_rows = 0
        self.last_is_decode = False

    def add_requests(self, reqs: list[tuple[str, list[int], int]]) -> None:
        for rid, prompt, max_new in reqs:
            self.sched.add_request(rid, prompt, max_new)

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    def step(self, sampled: np.ndarray) -> None:
        ops = self.sched.schedule()
        self.sched.update(ops, sampled)
        self.last_rows = ops.num_seqs
        self.last_is_decode = ops.num_seqs > 0 and ops.num_tokens == ops.num_seqs

    def in_decode_phase(self) -> bool:
        """Nothing waiting and every running request past its prefill (benchmark only)."""
        sched = self.sched
        return not sched._waiting and all(r.prefill_done for r in sched._running)

    def stats(self) -> dict:
        s = self.sched.stats()
        return {"retractions": s["num_retractions"], "prefix_hit_tokens": s["prefix_hit_tokens"]}


class TheirsRunner(peer.TokenSpeedRunner):
    def __init__(self, w: Workload) -> None:
        snap_pages = w.snapshot_images * -(-w.context // PAGE) * (2 if w.sliding_window else 1)
        super().__init__(
            num_pages=w.num_pages,
            page_size=PAGE,
            max_batch=w.num_reqs,
            max_tokens=BUDGET,
            sliding_window=w.sliding_window,
            snapshot_images=w.snapshot_images,
            snapshot_pages=snap_pages,
        )

    def step(self, sampled: np.ndarray) -> None:
        super().step(sampled.tolist())

    def in_decode_phase(self) -> bool:
        return self.sched.waiting_size() == 0 and self.sched.prefilling_size() == 0

    def stats(self) -> dict:
        return {
            "retractions": self.num_snapshots,
            "aborted": self.num_aborted,
            "prefix_hit_tokens": self.prefix_hit_tokens,
        }


# ---------------------------------------------------------------------- timing
@dataclasses.dataclass
class PassResult:
    step_us: np.ndarray
    decode_mask: np.ndarray
    rows: np.ndarray
    total_s: float
    stats: dict

    @property
    def median(self) -> float:
        return float(np.median(self.step_us))


def run_lockstep(
    entries: list[tuple[str, Workload]], seed: int, max_steps: int, flip: bool, clock: str = "wall"
) -> dict[tuple[str, str], PassResult]:
    """Run every (scheduler kind, workload) entry at once, alternating single steps (ours,
    theirs, ours, ...; `flip` reverses the order), so that load from other processes on the
    machine lands on all of them alike. Each step is timed on its own, by wall clock
    (perf_counter) or by this process's CPU time (process_time: blind to preemption by other
    processes, includes ~1.5 us of clock overhead per step)."""
    runners = {}
    for kind, w in entries:
        runner = OursRunner(w) if kind == "ours" else TheirsRunner(w)
        runner.add_requests([(f"r{i:05d}", p, w.out) for i, p in enumerate(w.prompts(seed))])
        runners[(w.key, kind)] = runner
    keys = list(runners)[::-1] if flip else list(runners)
    rngs = {key: np.random.default_rng(seed + 1) for key in keys}
    log = {key: ([], [], []) for key in keys}
    width = {(w.key, kind): w.num_reqs for kind, w in entries}
    if all(w.decode_only for _, w in entries):
        # context test: bring every runner to its pure-decode phase first (untimed), so the
        # timed decode steps of all entries interleave with each other, not with prefill work
        for key in keys:
            runner = runners[key]
            while not runner.in_decode_phase():
                runner.step(rngs[key].integers(1, VOCAB, size=width[key], dtype=np.int32))
        max_steps = min(w.measure_steps for _, w in entries)
    perf, cpu = time.perf_counter, time.process_time
    gc.collect()
    for _ in range(max_steps):
        live = [key for key in keys if runners[key].has_unfinished()]
        if not live:
            break
        for key in live:
            runner = runners[key]
            sampled = rngs[key].integers(1, VOCAB, size=width[key], dtype=np.int32)
            c0 = cpu()
            t0 = perf()
            runner.step(sampled)
            t1 = perf()
            c1 = cpu()
            times, decode, rows = log[key]
            times.append(t1 - t0 if clock == "wall" else c1 - c0)
            decode.append(runner.last_is_decode)
            rows.append(runner.last_rows)
    out = {}
    decode_only = {(w.key, kind): w.decode_only for kind, w in entries}
    for key, runner in runners.items():
        if runner.has_unfinished() and not decode_only[key]:
            raise RuntimeError(f"{key} did not finish in {max_steps} steps")
        times, decode, rows = log[key]
        us = np.asarray(times) * 1e6
        dmask = np.asarray(decode, bool)
        rows_a = np.asarray(rows)
        if decode_only[key]:  # context test: pure decode steps only
            us, rows_a, dmask = us[dmask], rows_a[dmask], dmask[dmask]
        out[key] = PassResult(us, dmask, rows_a, float(np.sum(times)), runner.stats())
    return out


def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="scaled-down smoke run")
    ap.add_argument("--passes", type=int, default=None, help="passes per scheduler (best is kept)")
    ap.add_argument("--only", default=None, help="comma-separated workload keys (a,b,c,d,e,ctx4k,ctx128k)")
    ap.add_argument("--no-peer", action="store_true", help="run ours only")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="per-step time: wall clock (default) or process CPU time",
    )
    args = ap.parse_args()
    passes = args.passes or (1 if args.quick else 3)
    ws = workloads(args.quick)
    if args.only:
        keys = set(args.only.split(","))
        ws = [w for w in ws if w.key in keys]
    with_peer = peer.available() and not args.no_peer
    kinds = ["ours", "theirs"] if with_peer else ["ours"]

    # lockstep groups: ours + theirs per workload; the context test runs 4k and 128k of one
    # scheduler together, so that its ratio is measured under the same machine load
    batches: list[list[Workload]] = []
    for w in ws:
        if w.decode_only and batches and batches[-1][0].decode_only:
            batches[-1].append(w)
        else:
            batches.append([w])
    groups: list[list[tuple[str, Workload]]] = []
    for batch in batches:
        if batch[0].decode_only:  # context test: each scheduler against itself (4k vs 128k)
            groups += [[(kind, w) for w in batch] for kind in kinds]
        else:  # ours vs theirs on one workload
            groups.append([(kind, w) for w in batch for kind in kinds])
    results: dict[tuple[str, str], PassResult] = {}
    for entries in groups:
        for p in range(passes):
            res = run_lockstep(entries, seed=0, max_steps=200_000, flip=p % 2 == 1, clock=args.clock)
            for key, r in res.items():
                best = results.get(key)
                if best is None or r.median < best.median:
                    results[key] = r
                print(
                    f"  {key[0]:8s} {key[1]:6s} pass {p}: {len(r.step_us)} steps, median "
                    f"{r.median:.0f} us, sum {r.total_s:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )

    print(
        f"# scheduler host cost per step: ours vs TokenSpeed "
        f"{'tokenspeed-scheduler ' + peer.version() if with_peer else '(not installed)'}; "
        f"best of {passes} pass(es), {args.clock} clock{' (--quick)' if args.quick else ''}"
    )
    print(f"# python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    print()
    print(
        "| workload | steps ours/theirs | median us ours | median us theirs | ratio | "
        "p90 ours | p90 theirs | decode median ours | decode median theirs | decode ratio | "
        "sum s ours/theirs | notes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w in ws:
        o = results[(w.key, "ours")]
        t = results.get((w.key, "theirs"))

        def dmed(r: PassResult) -> float:
            return float(np.median(r.step_us[r.decode_mask])) if r.decode_mask.any() else float("nan")

        notes = []
        if o.stats.get("retractions"):
            notes.append(f"ours {o.stats['retractions']} retractions")
        if t and t.stats.get("retractions"):
            notes.append(f"theirs {t.stats['retractions']} snapshots")
        if t and t.stats.get("aborted"):
            notes.append(f"theirs {t.stats['aborted']} aborted")
        if w.shared_prefix:
            prompt_tokens = w.num_reqs * (w.shared_prefix + w.prompt)
            notes.append(f"prompt hit ours {o.stats['prefix_hit_tokens'] / prompt_tokens:.1%}")
            if t:
                notes.append(f"theirs {t.stats['prefix_hit_tokens'] / prompt_tokens:.1%}")
        if w.key.startswith("d"):
            notes.append(
                f"median rows ours {np.median(o.rows):.0f}"
                + (f" theirs {np.median(t.rows):.0f}" if t else "")
            )
        if t is None:
            print(
                f"| {w.key}: {w.desc} | {len(o.step_us)} | {fmt(o.median)} | - | - | "
                f"{fmt(np.percentile(o.step_us, 90))} | - | {fmt(dmed(o))} | - | - | "
                f"{o.total_s:.2f} | {'; '.join(notes)} |"
            )
            continue
        print(
            f"| {w.key}: {w.desc} | {len(o.step_us)}/{len(t.step_us)} | {fmt(o.median)} | "
            f"{fmt(t.median)} | {o.median / t.median:.2f} | "
            f"{fmt(np.percentile(o.step_us, 90))} | {fmt(np.percentile(t.step_us, 90))} | "
            f"{fmt(dmed(o))} | {fmt(dmed(t))} | {dmed(o) / dmed(t):.2f} | "
            f"{o.total_s:.2f}/{t.total_s:.2f} | {'; '.join(notes)} |"
        )
    ctx = [k for k in ("ctx4k", "ctx128k") if (k, "ours") in results]
    if len(ctx) == 2:
        print()
        for kind in kinds:
            a, b = (results[(k, kind)].median for k in ctx)
            extra = " (target <= 1.2)" if kind == "ours" else ""
            print(
                f"{kind}: decode step at 128k / at 4k context = {fmt(b)} / {fmt(a)} us = {b / a:.2f}{extra}"
            )


if __name__ == "__main__":
    main()
