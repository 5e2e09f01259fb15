"""StepOps -> two packed device buffers (schema driven) -> the same arrays inside the jit."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from scheduler import Scheduler, SchedulerConfig
from scheduler.step_ops import LOGIT_BIAS_WIDTH, GroupStepOps, StepOps, device_schema
from tokenspeed_jax.runtime.shapes import ShapePolicy, StepShape, kv_levels
from tokenspeed_jax.runtime.step_inputs import layout_for, pack, unpack


def _random_ops(rng, r=5, t=24, layouts=((16, 8, 2), (8, 12, 3))) -> StepOps:
    """A StepOps with random values in every device field (u32 seeds above 2^31, bools)."""

    def arr(axis, dtype, width=0, delta=0):
        shape = {
            "row": (r,),
            "row+1": (r + 1,),
            "token": (t,),
            "row,delta": (r, delta),
            "row,width": (r, width),
            "row,bias": (r, LOGIT_BIAS_WIDTH),
        }[axis]
        if dtype == "f32":
            return rng.standard_normal(shape).astype(np.float32)
        if dtype == "bool":
            return rng.random(shape) < 0.5
        if dtype == "u32":
            return rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
        return rng.integers(-(2**31), 2**31 - 1, shape, dtype=np.int64).astype(np.int32)

    groups = tuple(
        GroupStepOps(**{n: arr(a, d, width=w, delta=dl) for n, a, d in device_schema(GroupStepOps)})
        for _, w, dl in layouts
    )
    fields = {n: arr(a, d) for n, a, d in device_schema(StepOps)}
    return StepOps(
        num_seqs=r, num_tokens=t, request_ids=tuple(f"r{i}" for i in range(r)), groups=groups, **fields
    )


def test_schema_covers_every_array_field():
    """Every numpy field of StepOps / GroupStepOps is tagged (nothing silently stays host-side)."""
    # copies: the host tier's page copies run as their own program before the step (PageCopies)
    host_fields = {"num_seqs", "num_tokens", "request_ids", "groups", "copies"}
    for cls, host in ((StepOps, host_fields), (GroupStepOps, set())):
        tagged = {n for n, _, _ in device_schema(cls)}
        assert tagged | host == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize(("bucket", "cols"), [(24, (8, 12)), (16, (4, 12)), (8, (1, 1))])
def test_pack_unpack_roundtrip_exact(bucket, cols):
    ops = _random_ops(np.random.default_rng(0))
    layout = layout_for(5, bucket, (2, 3), cols)
    i32, f32 = pack(ops, layout)
    assert i32.dtype == np.int32 and f32.dtype == np.float32
    # temperature, top_p and the three penalties per row + the [R, B] logit_bias values
    assert f32.size == 5 * 5 + 5 * LOGIT_BIAS_WIDTH
    got = jax.jit(unpack, static_argnums=2)(i32, f32, layout)
    for name, axis, _ in device_schema(StepOps):
        want = getattr(ops, name)[:bucket] if axis == "token" else getattr(ops, name)
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), want, err_msg=name)
        assert np.asarray(getattr(got, name)).dtype == want.dtype, name
    for g, grp in enumerate(ops.groups):
        for name, axis, _ in device_schema(GroupStepOps):
            want = getattr(grp, name)
            if axis == "row,width":
                want = want[:, : cols[g]]
            np.testing.assert_array_equal(np.asarray(getattr(got.groups[g], name)), want, err_msg=name)


def test_device_ops_fields_are_the_schema():
    """The typed device view names exactly the schema's device fields, in order."""
    from tokenspeed_jax.runtime.device_ops import DeviceGroupOps, DeviceOps

    names = [f.name for f in dataclasses.fields(DeviceOps)]
    assert names == [n for n, _, _ in device_schema(StepOps)] + ["groups"]
    assert [f.name for f in dataclasses.fields(DeviceGroupOps)] == [
        n for n, _, _ in device_schema(GroupStepOps)
    ]


def test_kv_levels_ladder():
    # one group, 256 columns of 16 tokens (4096 tokens), shortest level 256 tokens
    assert kv_levels((256,), (16,), 256) == (
        (256, (16,)),
        (512, (32,)),
        (1024, (64,)),
        (2048, (128,)),
        (4096, (256,)),
    )
    # capacity not a power of two: the last level is the full width
    assert kv_levels((30,), (16,), 128)[-1] == (480, (30,))
    # groups of different page sizes cut at the same token count; a narrow group saturates
    levels = kv_levels((64, 4), (16, 8), 256)
    assert levels[0] == (256, (16, 4)) and levels[-1] == (1024, (64, 4))


def test_shape_policy_warmup_levels():
    policy = ShapePolicy.build((64,), (16,), 64, backend="reference", min_token_bucket=16)
    assert policy.buckets == (16, 32, 64) and [t for t, _ in policy.kv_levels] == [256, 512, 1024]
    assert policy.warmup_levels() == (0, 1, 2) == policy.warmup_levels(5000)  # none covers it
    assert policy.warmup_levels(1) == (0,) and policy.warmup_levels(257) == (0, 1)
    with pytest.raises(ValueError, match="max_kv_len"):
        policy.warmup_levels(0)
    pallas = ShapePolicy.build((64,), (16,), 64, backend="pallas")
    assert pallas.kv_levels == ((1024, (64,)),) and len(pallas.shape_keys) == 3
    padding = Scheduler(
        SchedulerConfig(num_pages=8, max_batch_requests=2, max_context_len=64, max_scheduled_tokens=64)
    ).padding_ops()
    assert policy.warmup_shapes(padding, 300) == tuple(
        StepShape(b, lv) for b in (16, 32, 64) for lv in (0, 1)
    )


def test_runner_kv_bucket_follows_the_longest_row():
    from tokenspeed_jax import LLM

    llm = LLM(
        "tiny-random",
        num_pages=256,
        max_batch_requests=4,
        max_scheduled_tokens=64,
        max_context_len=1024,
        attention_backend="reference",
    )
    runner = llm.engine.runner
    shapes = runner.shapes
    assert [t for t, _ in shapes.kv_levels] == [256, 512, 1024]
    assert len(runner.shape_keys) == len(shapes.buckets) * 3
    cfg = llm.engine.scheduler.config
    sched = Scheduler(dataclasses.replace(cfg, max_scheduled_tokens=1024))
    sched.add_request("a", [5] * 300, 4)
    ops = sched.schedule()
    assert shapes.kv_levels[shapes.kv_level_for(ops)][0] == 512  # 300 tokens -> the 512 level
    sched2 = Scheduler(
        SchedulerConfig(
            num_pages=64,
            max_batch_requests=4,
            max_context_len=1024,
            groups=cfg.groups,
            max_scheduled_tokens=64,
        )
    )
    sched2.add_request("b", [5] * 10, 4)
    assert shapes.kv_levels[shapes.kv_level_for(sched2.schedule())][0] == 256
