"""`DeviceOps`: a step's `StepOps` as the jitted step reads it (typed, a pytree).

`step_inputs.unpack` cuts the two packed buffers into these fields inside the jit. The names
are `StepOps` / `GroupStepOps`' device fields (their comments there give shapes, meaning and
padding; tests/tokenspeed_jax/test_step_inputs.py checks the lists equal the schema), so mypy
checks every read the model, sampler and verifier make. Host-only fields (`num_seqs`,
`request_ids`, ...) never reach the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from scheduler.step_ops import StepOps, device_schema

# the per-row fields (schema axis "row"): what the LM head and the sampler cut to the used rows
ROW_FIELDS = tuple(name for name, axis, _ in device_schema(StepOps) if axis == "row")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceGroupOps:
    """One cache group's page-table mirror update (`GroupStepOps`)."""

    begins: jax.Array
    sizes: jax.Array
    new_pages: jax.Array
    rows: jax.Array
    row_lens: jax.Array
    hole_slots: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceOps:
    """The device fields of `StepOps`, as jax arrays (R rows, T tokens of the step's bucket)."""

    req_slots: jax.Array
    full_refresh: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    sample_mask: jax.Array
    draft_lens: jax.Array
    token_ids: jax.Array
    token_from_prev: jax.Array
    positions: jax.Array
    token_rows: jax.Array
    prompt_targets: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seeds: jax.Array
    sample_index: jax.Array
    prompt_lens: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    logit_bias_ids: jax.Array
    logit_bias_values: jax.Array
    top_logprobs: jax.Array
    groups: tuple[DeviceGroupOps, ...]

    def replace(self, **changes: Any) -> DeviceOps:
        return dataclasses.replace(self, **changes)

    def first_rows(self, n: int) -> DeviceOps:
        """The same step with every per-row field cut to its first `n` rows (the sampler's
        rows: a step has at most one row per token)."""
        cut: dict[str, Any] = {k: getattr(self, k)[:n] for k in ROW_FIELDS}
        return dataclasses.replace(self, **cut)
