"""`Runner`: what an `Engine` needs of the device side, and nothing it probes around."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from scheduler import StepOps

if TYPE_CHECKING:  # the runner modules import jax; the engine does not need it
    from scheduler.cache_layout import CacheLayout
    from tokenspeed_jax.runtime.step_outputs import StepHandle, StepResult
    from tokenspeed_jax.runtime.step_programs import StepPrograms


class Runner(Protocol):
    """What an `Engine` drives: `runtime.runner.ModelRunner`, or
    `distributed.runner.DistributedRunner` on the leader of a multi-process run."""

    @property
    def num_compiles(self) -> int:
        """jit traces so far (one per step shape key)."""

    @property
    def layout(self) -> CacheLayout:
        """The setup value the runner was built from (honor_full_refresh)."""

    @property
    def buckets(self) -> tuple[int, ...]:
        """The token buckets of its step shapes, ascending (the scheduler packs steps to them)."""

    @property
    def backend(self) -> str:
        """The attention backend it resolved ("pallas", "native", "reference")."""

    @property
    def programs(self) -> StepPrograms | None:
        """Its per-shape executables and their start-up record; None on a runner that keeps no
        per-shape record (the multi-process leader's)."""

    supports_token_mask: bool  # dispatch takes structured outputs' token_mask

    def dispatch(self, ops: StepOps, token_mask: np.ndarray | None = None) -> StepHandle:
        """Enqueue one step on the device and return at once (token_mask: structured outputs'
        i32[R, ceil(V / 32)] allowed tokens, or None; runners with `supports_token_mask`)."""

    def collect(self, handle: StepHandle) -> StepResult:
        """Block until a dispatched step is done; its host results."""

    def warmup(
        self, padding_ops: StepOps, max_kv_len: int | None = None, *, progress: bool = False, workers: int = 2
    ) -> int:
        """Make the step shapes ready; returns how many it made ready."""

    def host_mirrors(self) -> list[np.ndarray]:
        """The device page-table mirrors after the last dispatched step (debug checks)."""
