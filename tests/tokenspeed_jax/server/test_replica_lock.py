"""`ReplicaState.urgent`: a request handler waiting for a replica's lock gets it before the
stepping thread's next step (a plain lock let the stepping thread win it back step after step,
freezing the server's event loop)."""

from __future__ import annotations

import threading
import time

from tokenspeed_jax.server.replica_state import ReplicaState

STEP_S = 0.02


def _handler_waits(rep: ReplicaState) -> list[float]:
    stop = threading.Event()

    def stepping() -> None:  # AsyncEngine._loop's shape: let handlers in, then step locked
        while not stop.is_set():
            rep.let_handlers_in()
            with rep.lock:
                time.sleep(STEP_S)

    thread = threading.Thread(target=stepping, daemon=True)
    thread.start()
    waits = []
    try:
        for _ in range(10):
            time.sleep(STEP_S / 3)
            t0 = time.perf_counter()
            with rep.urgent():
                waits.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join(timeout=5)
    return waits


def test_a_waiting_handler_goes_before_the_next_step():
    waits = _handler_waits(ReplicaState(0, None))  # type: ignore[arg-type]
    # at most the step in flight, plus scheduling slack on a loaded CI machine
    assert max(waits) < 2 * STEP_S + 0.05, waits


def test_grace_is_bounded_when_a_handler_never_comes():
    rep = ReplicaState(0, None)  # type: ignore[arg-type]
    with rep._count_lock:
        rep._waiting_handlers = 1  # a handler that announced itself and never took the lock
    t0 = time.perf_counter()
    rep.let_handlers_in(grace_s=0.02)
    assert time.perf_counter() - t0 < 0.5
