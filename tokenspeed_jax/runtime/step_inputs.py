"""Moves a `StepOps` to the device as two packed buffers, driven by the StepOps schema.

Every device field of `StepOps` / `GroupStepOps` is tagged with its axis and wire dtype in
`scheduler/step_ops.py` (`device_schema`). For one step's shape key (token bucket, kv columns of
each group) `layout_for` turns the schema into a static `StepLayout`: where each field sits in
one int32 buffer (i32, bool and u32 fields, bit-exact) or one float32 buffer (f32 fields).
`pack` fills the two numpy buffers (host: one copy per field, then two transfers instead of one
per array), `unpack` cuts them back into a typed `DeviceOps` inside the jitted step (free views).
A new StepOps field needs its schema tag and its `DeviceOps` field (a test checks they agree).

Cuts applied while packing (shapes depend only on the shape key):
  "token" fields keep the first `bucket` entries (the rest is padding by construction);
  "row,width" fields keep the first `cols[g]` columns: the step's kv bucket covers its longest
  row, so later columns of a refreshed row are holes (the device pads them back with zeros).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from scheduler.cache_layout import CacheLayout
from scheduler.page_table_oracle import clamped_rows
from scheduler.step_ops import LOGIT_BIAS_WIDTH, GroupStepOps, StepOps, device_schema
from tokenspeed_jax.runtime.device_ops import DeviceGroupOps, DeviceOps

logger = logging.getLogger("tokenspeed_jax.runtime.runner")  # the runner's warnings, as before
_STEP_SCHEMA = device_schema(StepOps)
_GROUP_SCHEMA = device_schema(GroupStepOps)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One field's place in the packed buffers. group -1 = a StepOps field, else its group."""

    group: int
    name: str
    dtype: str  # schema wire dtype: i32 | bool | u32 | f32
    shape: tuple[int, ...]
    offset: int  # into the i32 buffer, or the f32 buffer when dtype == "f32"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Static (hashable: a jit static argument) packing of one shape key."""

    bucket: int  # token bucket
    cols: tuple[int, ...]  # kv columns per group (page-table columns the step may read)
    slots: tuple[Slot, ...]
    i32_size: int
    f32_size: int


def _shape(axis: str, rows: int, bucket: int, delta: int, cols: int) -> tuple[int, ...]:
    return {
        "row": (rows,),
        "row+1": (rows + 1,),
        "token": (bucket,),
        "row,delta": (rows, delta),
        "row,width": (rows, cols),
        "row,bias": (rows, LOGIT_BIAS_WIDTH),
    }[axis]


def layout_for(rows: int, bucket: int, deltas: tuple[int, ...], cols: tuple[int, ...]) -> StepLayout:
    """The packing of a step with R = `rows`, token bucket `bucket`, per-group tail-delta widths
    `deltas` (N_g) and kv columns `cols`."""
    slots, sizes = [], {"i": 0, "f": 0}

    def add(group: int, name: str, axis: str, dtype: str, delta: int = 0, width: int = 0) -> None:
        shape = _shape(axis, rows, bucket, delta, width)
        buf = "f" if dtype == "f32" else "i"
        slots.append(Slot(group, name, dtype, shape, sizes[buf]))
        sizes[buf] += int(np.prod(shape))

    for name, axis, dtype in _STEP_SCHEMA:
        add(-1, name, axis, dtype)
    for g, (delta, width) in enumerate(zip(deltas, cols, strict=True)):
        for name, axis, dtype in _GROUP_SCHEMA:
            add(g, name, axis, dtype, delta, width)
    return StepLayout(bucket, tuple(cols), tuple(slots), sizes["i"], sizes["f"])


def pack(ops: StepOps, layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
    """(i32[layout.i32_size], f32[layout.f32_size]) host buffers holding `ops` cut to `layout`."""
    ints, floats = [], []
    for s in layout.slots:
        src = getattr(ops if s.group < 0 else ops.groups[s.group], s.name)
        src = src[: s.shape[0]] if len(s.shape) == 1 else src[:, : s.shape[1]]
        if s.dtype == "f32":
            floats.append(src.reshape(-1))
        else:  # u32 travels as the same 32 bits; bool as 0 / 1
            ints.append(src.reshape(-1).view(np.int32) if s.dtype == "u32" else src.reshape(-1))
    # one concatenate per buffer: a per-field copy loop costs several times more host time
    return (np.concatenate(ints, dtype=np.int32, casting="unsafe"), np.concatenate(floats, dtype=np.float32))


def unpack(i32: jax.Array, f32: jax.Array, layout: StepLayout) -> DeviceOps:
    """Inside the jit: the step's `DeviceOps`, cut from the buffers (free views)."""
    fields: dict[str, jax.Array] = {}
    groups: list[dict[str, jax.Array]] = [{} for _ in layout.cols]
    for s in layout.slots:
        src = f32 if s.dtype == "f32" else i32
        x = src[s.offset : s.offset + s.size].reshape(s.shape)
        if s.dtype == "bool":
            x = x != 0
        elif s.dtype == "u32":
            x = jax.lax.bitcast_convert_type(x, jnp.uint32)
        (fields if s.group < 0 else groups[s.group])[s.name] = x
    return DeviceOps(**fields, groups=tuple(DeviceGroupOps(**g) for g in groups))


def warn_clamped(ops: StepOps, lay: CacheLayout) -> None:
    """DESIGN §6 rule 3: a row whose update outgrows its mirror is clamped on the device (never
    a crash); name its request. `add_request` admits no such request, so this is the guard
    for hand-built StepOps (vectorised: a few µs per step)."""
    for g, grp in enumerate(ops.groups):
        rows = clamped_rows(
            ops.req_slots,
            grp.begins,
            grp.sizes,
            ops.full_refresh,
            grp.row_lens,
            lay.widths[g],
            lay.honor_full_refresh,
        )
        for i in rows.tolist():
            rid = ops.request_ids[i] if i < len(ops.request_ids) else f"row {i}"
            logger.warning(
                "page-table row of request %s in cache group %s outgrows width %d; clamped",
                rid,
                lay.groups[g].group_id,
                lay.widths[g],
            )
