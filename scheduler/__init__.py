"""Host-side paged-KV scheduler: pure Python + numpy (never imports jax)."""

from __future__ import annotations

from scheduler.step_ops import GroupLayout, GroupStepOps, StepOps

__all__ = ["GroupLayout", "GroupStepOps", "StepOps"]
