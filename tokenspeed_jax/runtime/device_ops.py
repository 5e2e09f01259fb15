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
import jax.numpy as jnp

from scheduler.step_ops import StepOps, device_schema
from tokenspeed_jax.page_table import update_rows

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


def update_mirrors(
    mirrors: tuple[jax.Array, ...], ops: DeviceOps, honor_full_refresh: bool
) -> tuple[jax.Array, ...]:
    """Every group's device page-table mirror after the step's row updates."""
    return tuple(
        update_rows(
            mirror, ops.req_slots, g.begins, g.sizes, g.new_pages,
            ops.full_refresh, g.rows, g.row_lens,
            honor_full_refresh=honor_full_refresh, hole_slots=g.hole_slots,
        )
        for mirror, g in zip(mirrors, ops.groups, strict=True)
    )  # fmt: skip


def input_tokens(ops: DeviceOps, last_tokens: jax.Array) -> jax.Array:
    """The step's input ids i32[T]: a token flagged `token_from_prev` is the one the previous
    step sampled for its row's slot (overlapped scheduling: it never travelled to the host)."""
    token_slots = jnp.take(ops.req_slots, ops.token_rows, mode="clip")
    prev_tokens = jnp.take(last_tokens, token_slots, mode="clip")
    return jnp.where(ops.token_from_prev, prev_tokens, ops.token_ids)
