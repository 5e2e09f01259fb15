"""Driver for the real TokenSpeed C++ scheduler (PyPI `tokenspeed-scheduler==0.1.42`).

Used by `benchmarks/scheduler.py` as the performance peer. Call pattern as documented in
`../shared/peers/tokenspeed-scheduler.md` (checked against the installed wheel):

  plan = sched.next_execution_plan()         # schedule
  read what a runtime needs from the plan    # rows, lengths, token ids, block tables, page ops
  ev = ExecutionEvent(); ack cache ops; one ExtendResult per row (+ Finish); sched.advance(ev)

The wheel never finishes a request on its own: the driver counts generated tokens and sends
`Finish` once a request reached its `max_new_tokens`. Requests are submitted with
`max_new_tokens=0` (what the TokenSpeed runtime does: admission reserves prompt + 1 and decode
pages are added one at a time).
"""

from __future__ import annotations

import os

os.environ.setdefault("SPDLOG_LEVEL", "error")  # the extension logs to stdout otherwise

try:  # optional dependency (the project's `bench` extra)
    import tokenspeed_scheduler as ts
except ImportError:  # pragma: no cover - reported by the benchmark
    ts = None


def available() -> bool:
    return ts is not None


def version() -> str:
    try:
        from importlib.metadata import version as _v

        return _v("tokenspeed-scheduler")
    except Exception:  # pragma: no cover
        return "?"


class TokenSpeedRunner:
    """One workload on the TokenSpeed scheduler; `step()` runs one plan -> feedback cycle."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_batch: int,
        max_tokens: int,
        sliding_window: int | None = None,
        snapshot_images: int = 0,
        snapshot_pages: int = 0,
        mixed: bool = True,
    ) -> None:
        if ts is None:
            raise RuntimeError(
                "tokenspeed-scheduler is not installed (pip install 'tokenspeed-scheduler==0.1.42')"
            )
        cfg = ts.SchedulerConfig()
        cfg.prefix_granularity = page_size
        cfg.num_device_pages = num_pages  # includes the null page 0, like our BlockPool
        cfg.num_host_pages = 0
        cfg.disable_l2_cache = True
        cfg.num_snapshot_pages = snapshot_pages + 1 if snapshot_images else 1
        cfg.max_retracted_requests = snapshot_images
        cfg.max_scheduled_tokens = max_tokens
        cfg.max_batch_size = max_batch
        cfg.enable_mixed_prefill_decode = mixed
        groups = [ts.CacheGroupConfig("full", page_size, num_pages, ts.AttnKind.Full)]
        if sliding_window:
            groups.append(
                ts.CacheGroupConfig(
                    "swa",
                    page_size,
                    num_pages,
                    ts.AttnKind.SlidingWindow,
                    sliding_window_tokens=sliding_window,
                )
            )
        cfg.cache_groups = groups
        self.sched = ts.Scheduler(cfg)
        self._ack = {
            "SnapshotOp": ts.Cache.SnapshotDoneEvent,
            "RestoreOp": ts.Cache.RestoreDoneEvent,
            "WriteBackOp": ts.Cache.WriteBackDoneEvent,
            "LoadBackOp": ts.Cache.LoadBackDoneEvent,
        }
        self.remaining: dict[str, int] = {}
        self.num_aborted = 0
        self.num_snapshots = 0
        self.num_restores = 0
        self.prefix_hit_tokens = 0
        self._seen: set[str] = set()
        self.last_rows = 0
        self.last_is_decode = False
        self.launch: tuple = ()

    def add_requests(self, reqs: list[tuple[str, list[int], int]]) -> None:
        specs = []
        for rid, prompt, max_new in reqs:
            spec = ts.RequestSpec()
            spec.request_id = rid
            spec.tokens = prompt
            spec.max_new_tokens = 0
            specs.append(spec)
            self.remaining[rid] = max_new
        self.sched.submit_requests(specs)

    def has_unfinished(self) -> bool:
        return bool(self.remaining)

    def step(self, sampled: list[int]) -> None:
        """Plan one step, read it as a runtime would, feed back `sampled[i]` for row i."""
        sched = self.sched
        plan = sched.next_execution_plan()
        op = plan.forward[0]
        rids = op.request_ids
        # what a runtime reads to launch the step (kept on self so nothing is optimised away)
        nx = op.num_extends()
        prefix = op.extend_prefix_lens
        inputs = op.input_lengths
        prefill = op.prefill_lengths
        self.launch = (
            op.request_pool_indices,
            op.input_ids,
            op.decode_input_ids,
            op.block_tables_arrays(),
            plan.pages_to_zero_arrays(),
            plan.pages_to_copy_arrays(),
        )
        ev = ts.ExecutionEvent()
        for cop in plan.cache:
            kind = type(cop).__name__
            if kind == "SnapshotOp":
                self.num_snapshots += len(cop.op_ids)
            elif kind == "RestoreOp":
                self.num_restores += len(cop.op_ids)
            ack = self._ack[kind]
            for op_id in cop.op_ids:
                done = ack()
                done.op_id = op_id
                ev.add_event(done)
        for ab in plan.aborts:
            if self.remaining.pop(ab.request_id, None) is not None:
                self.num_aborted += 1
        remaining = self.remaining
        for i, rid in enumerate(rids):
            res = ts.ForwardEvent.ExtendResult()
            res.request_id = rid
            if i < nx and prefix[i] + inputs[i] < prefill[i]:
                res.tokens = []  # intermediate chunk: owes an empty result
                ev.add_event(res)
                continue
            res.tokens = [sampled[i]]
            ev.add_event(res)
            left = remaining[rid] - 1
            if left:
                remaining[rid] = left
            else:
                del remaining[rid]
                fin = ts.ForwardEvent.Finish()
                fin.request_id = rid
                ev.add_event(fin)
        sched.advance(ev)
        self.last_rows = len(rids)
        self.last_is_decode = nx == 0 and len(rids) > 0
        seen = self._seen
        for i in range(nx):  # prefix hit = extend_prefix_lens of a request's first chunk
            if rids[i] not in seen:
                seen.add(rids[i])
                self.prefix_hit_tokens += prefix[i]

    def peak_probe(self) -> int:
        """Pages held by live requests (slow: ~0.1 ms; call outside timed regions)."""
        return self.sched.active_lcm_blocks()
