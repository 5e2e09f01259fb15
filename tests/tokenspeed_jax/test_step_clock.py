"""`StepClock`: the device-idle gap bound from host probes, with fake step handles and a fake
clock (deterministic: no sleeps)."""

from __future__ import annotations

import pytest

import tokenspeed_jax.engine.step_clock as step_clock
from tokenspeed_jax.engine.step_clock import StepClock


class FakeHandle:
    def __init__(self) -> None:
        self.ready = False

    def is_ready(self) -> bool:
        return self.ready


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def t(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(step_clock, "time", fake)
    return fake


def test_gapless_when_the_previous_step_still_runs(t):
    clock = StepClock()
    a, b = FakeHandle(), FakeHandle()
    clock.dispatched(a, decode=True, pipelined=False)
    t.now += 5.0
    clock.dispatched(b, decode=True, pipelined=True)  # a still running: no gap
    s = clock.summary()
    assert clock.critical_s == 0.0 and s["gapless_dispatch_fraction"] == 1.0
    assert s["pipelined_fraction"] == 1.0 and s["decode_critical_ms_p90"] == 0.0


def test_gap_is_bounded_by_the_last_time_the_step_was_seen_running(t):
    clock = StepClock()
    a, b = FakeHandle(), FakeHandle()
    clock.dispatched(a, decode=True, pipelined=False)
    t.now += 0.020
    clock.probe()  # still running at 100.020
    a.ready = True
    t.now += 0.030
    clock.probe()  # finished: the bound stays at the last sighting
    t.now += 0.005
    clock.dispatched(b, decode=True, pipelined=True)
    assert clock.critical_s == pytest.approx(0.035)
    assert clock.decode_critical_s == clock.critical_s
    assert clock.summary()["pipelined_decode_critical_ms_per_step"] == pytest.approx(35.0)


def test_blocking_wait_marks_the_device_busy_until_it_returns(t):
    clock = StepClock()
    a, b = FakeHandle(), FakeHandle()
    clock.dispatched(a, decode=False, pipelined=False)
    t.now += 0.030
    a.ready = True
    clock.waited(0.030, blocked=True)  # the synchronous loop: blocked on a until now
    t.now += 0.010
    clock.dispatched(b, decode=False, pipelined=False)
    assert clock.critical_s == pytest.approx(0.010)  # only the host turnaround after the wait
    t.now += 0.020
    b.ready = True
    clock.waited(0.020, blocked=True)
    clock.call_done(0.070)  # one engine call of 70 ms, 50 of them blocked
    s = clock.summary()
    assert s["wait_ms_per_step"] == pytest.approx(25.0)  # 50 ms over 2 steps
    assert s["host_ms_per_step"] == pytest.approx(10.0)  # (70 - 50) ms over 2 steps
    # first dispatch 100.000 -> last result 100.060, minus the 10 ms gap, over 2 steps
    assert s["device_ms_per_step"] == pytest.approx(25.0)
    assert s["decode_critical_ms_per_step"] == 0.0  # no decode-only step
