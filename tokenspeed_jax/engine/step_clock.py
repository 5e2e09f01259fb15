"""`StepClock`: where the engine loop's time goes, and how long the device sat idle between steps.

Per step the engine reports: host time (everything the loop does except waiting for results:
schedule, device_put, dispatch, update, bookkeeping), wait time (blocked on a step's results),
and the host critical path: the gap between the end of step N on the device and the moment
step N+1 is queued behind it. JAX gives no device timestamps, so the gap is bounded from the
host by cheap non-blocking probes (`handle.is_ready()`): `busy_seen` is the last time the newest
dispatched step was observed still running. When step N+1 is dispatched:
  - step N not finished yet -> the device went from N to N+1 without waiting: gap 0;
  - step N finished -> it ended after `busy_seen`, so the gap is at most now - busy_seen.
The synchronous loop blocks on every step, so there `busy_seen` is the moment the blocking
wait returned and the gap is the whole host turnaround (update + schedule + dispatch). The sum
of the gaps over the loop's wall time bounds the device-idle fraction from above.

A step is "pipelined" when it was dispatched while the previous one was still in flight (the
overlapped loop's normal case). The overlapped loop also restarts from empty: when nothing could
be planned ahead (every running request ends with its token in flight and nobody can be
admitted until those outputs are back, e.g. a closed-loop client), the next step waits for the
results like in the synchronous loop. Both are reported, and the recent per-step gaps are kept
for percentiles.
"""

from __future__ import annotations

import collections
import time

import numpy as np


class StepClock:
    """Accumulates host / wait / critical-path seconds over the engine's steps."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_steps = 0  # device steps dispatched
        self.host_s = 0.0  # loop time not spent blocked on results
        self.wait_s = 0.0  # loop time blocked on results
        self.critical_s = 0.0  # upper bound of device idle between consecutive steps
        self.num_gapless = 0  # dispatches that found the previous step still running
        self.decode_steps = 0  # steps whose rows are all one-token decodes
        self.decode_host_s = 0.0  # host time of the engine calls that dispatched them
        self.decode_critical_s = 0.0
        self._handle = None  # newest dispatched step
        self._busy_seen = 0.0
        self._decode = False  # the current engine call dispatched a decode-only step
        self._first_dispatch: float | None = None
        self._last_result = 0.0  # when the newest collect returned
        # (decode, pipelined, gap seconds) of recent steps
        self.gaps: collections.deque[tuple[bool, bool, float]] = collections.deque(maxlen=100_000)
        self._call_wait = 0.0

    def probe(self) -> None:
        """Cheap: note the time if the newest dispatched step is still running."""
        h = self._handle
        if h is not None and not h.is_ready():
            self._busy_seen = time.perf_counter()

    def dispatched(self, handle, decode: bool, pipelined: bool) -> None:
        """Call right after `runner.dispatch` returned `handle` (a non-empty step); `decode`:
        every row of the step is a one-token decode; `pipelined`: the previous step had not
        been collected when this one was planned."""
        now = time.perf_counter()
        prev = self._handle
        if prev is not None:
            gap = 0.0
            if prev.is_ready():
                gap = now - self._busy_seen
                self.critical_s += gap
                if decode:
                    self.decode_critical_s += gap
            else:
                self.num_gapless += 1
            self.gaps.append((decode, pipelined, gap))
        if self._first_dispatch is None:
            self._first_dispatch = now
        self.num_steps += 1
        self.decode_steps += decode
        self._decode = decode
        self._handle = handle
        self._busy_seen = now

    def waited(self, seconds: float, blocked: bool) -> None:
        """Call after a blocking collect that took `seconds`. When it really blocked, the device
        was busy until the wait returned: with the collected step, or if a newer step is queued
        behind it, with that one from then on."""
        self.wait_s += seconds
        self._call_wait += seconds
        self._last_result = time.perf_counter()
        if blocked:
            self._busy_seen = self._last_result

    def call_done(self, seconds: float) -> None:
        """Call at the end of each engine step call with its total duration (wait included)."""
        host = seconds - self._call_wait
        self.host_s += host
        if self._decode:
            self.decode_host_s += host
        self._decode = False
        self._call_wait = 0.0

    def summary(self) -> dict:
        """Milliseconds per dispatched step (host time excludes the wait for results)."""
        n, d = max(self.num_steps, 1), max(self.decode_steps, 1)
        dec = [g for decode, _, g in self.gaps if decode]
        piped = [g for decode, p, g in self.gaps if decode and p]
        ms = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else 0.0  # noqa: E731
        # device time: the span from the first dispatch to the last result minus the idle gaps
        # (a lower bound, as the gaps are upper bounds; idle time between bursts counts as gap)
        span = self._last_result - self._first_dispatch if self._first_dispatch else 0.0
        return {
            "host_ms_per_step": 1e3 * self.host_s / n,
            "device_ms_per_step": 1e3 * max(0.0, span - self.critical_s) / n,
            "wait_ms_per_step": 1e3 * self.wait_s / n,
            "critical_ms_per_step": 1e3 * self.critical_s / n,
            "decode_host_ms_per_step": 1e3 * self.decode_host_s / d,
            "decode_critical_ms_per_step": 1e3 * self.decode_critical_s / d,
            "decode_critical_ms_p50": ms(dec, 50),
            "decode_critical_ms_p90": ms(dec, 90),
            "pipelined_decode_critical_ms_per_step": 1e3 * sum(piped) / max(len(piped), 1),
            "pipelined_fraction": sum(p for _, p, _ in self.gaps) / max(len(self.gaps), 1),
            "gapless_dispatch_fraction": self.num_gapless / max(self.num_steps - 1, 1),
        }
