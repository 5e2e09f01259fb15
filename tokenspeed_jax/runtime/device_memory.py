"""What the engine may take of an accelerator's memory: vLLM's `gpu_memory_utilization` on JAX's
allocator (issue 46).

JAX's GPU allocator is capped at `XLA_PYTHON_CLIENT_MEM_FRACTION` of the memory free when its
backend starts (75% by default), and `device.memory_stats()` reports that cap as `bytes_limit`,
not the card's size. So `claim_allocator(u)`, called before the backend starts, sets the cap to
u (unless the user set the variable: theirs stands); the engine's share is then
`u x total`, with total estimated as `bytes_limit / cap fraction`, and never more than the cap.
Out of that share come the bytes already in use (the weights), the largest step's temporaries
(XLA's `memory_analysis()` of its executable: `ModelRunner.largest_step_temp_bytes`), the
fixed per-slot state, and the rest is the page pool (`state.pages_from_memory`).
"""

from __future__ import annotations

import dataclasses
import os

ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_FRACTION = 0.75  # JAX's own cap when the variable is unset


def claim_allocator(utilization: float) -> bool:
    """Before jax's backends start: cap its GPU allocator at `utilization` of the memory (sets
    `XLA_PYTHON_CLIENT_MEM_FRACTION`). Does nothing (returns False) when the user set that
    variable or a backend already started; harmless on CPU (only GPU clients read it)."""
    if ALLOCATOR_ENV in os.environ:
        return False
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):  # a jax without the query: leave the allocator alone
        return False
    os.environ[ALLOCATOR_ENV] = repr(float(utilization))
    return True


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device's allocator view: `limit` (the allocator's cap), `in_use`, `total` (the
    device's memory, estimated from the cap and its fraction)."""

    limit: int
    in_use: int
    total: int

    def engine_budget(self, utilization: float) -> int:
        """Bytes the engine may still allocate: `utilization` of the total, at most the cap,
        less what is in use."""
        return min(int(utilization * self.total), self.limit) - self.in_use


def device_memory(device) -> DeviceMemory | None:
    """The allocator statistics of `device`; None for a CPU (no `bytes_limit`)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    limit = int(stats["bytes_limit"])
    try:
        fraction = float(os.environ.get(ALLOCATOR_ENV, JAX_DEFAULT_FRACTION))
    except ValueError:
        fraction = JAX_DEFAULT_FRACTION
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform" or not 0 < fraction <= 1:
        fraction = 1.0
    return DeviceMemory(limit=limit, in_use=int(stats.get("bytes_in_use", 0)), total=int(limit / fraction))
