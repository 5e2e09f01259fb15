"""In-process pieces of the multi-process runtime: message framing, launch config, CLI flags,
liveness, multi-process device grids (no second process needed)."""

from __future__ import annotations

import argparse

import jax
import numpy as np
import pytest

from scheduler import Scheduler, SchedulerConfig
from tokenspeed_jax.cli.common import add_distributed_args, add_engine_args, distributed_config
from tokenspeed_jax.distributed.launch import DistributedConfig, Liveness, resolve
from tokenspeed_jax.distributed.runner import HEADER, STEP, frame, unframe
from tokenspeed_jax.runtime.step_inputs import layout_for, pack


def _real_ops():
    """A real StepOps with a prefill, a full refresh and sampling params set."""
    cfg = SchedulerConfig(
        num_pages=64, page_size=4, max_batch_requests=4, max_scheduled_tokens=32, max_context_len=64
    )
    sched = Scheduler(cfg)
    sched.add_request("a", list(range(1, 12)), 4, temperature=0.7, top_p=0.9, top_k=5, seed=2**31 + 5)
    sched.add_request("b", list(range(3, 9)), 4)
    return sched, sched.schedule()


def test_message_frame_roundtrip():
    """The broadcast message: header + the runner's own i32 / f32 step buffers, bit for bit."""
    sched, ops = _real_ops()
    lays = sched.config.group_layouts()
    layout = layout_for(4, 16, tuple(x.delta_width for x in lays), tuple(x.width for x in lays))
    i32, f32 = pack(ops, layout)
    msg = frame(STEP, 7, replica=1, bucket=16, level=2, i32=i32, f32=f32)
    assert msg.dtype == np.int32 and msg.size == HEADER + i32.size + f32.size
    padded = np.concatenate([msg, np.zeros(5, np.int32)])  # channels are fixed-size
    head, i2, f2 = unframe(padded)
    assert head == dict(control=STEP, seq=7, replica=1, bucket=16, level=2)
    np.testing.assert_array_equal(i2, i32)
    assert f2.dtype == np.float32 and f2.tobytes() == f32.tobytes()  # 0.7 etc. bit-exact
    with pytest.raises(RuntimeError, match="bad message"):
        unframe(np.zeros(HEADER, np.int32))


def test_config_validation_and_env():
    env = {
        "TOKENSPEED_COORDINATOR": "10.0.0.1:1234",
        "TOKENSPEED_NUM_PROCESSES": "2",
        "TOKENSPEED_PROCESS_ID": "1",
    }
    cfg = DistributedConfig.from_env(env)
    assert (cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.is_leader) == (
        "10.0.0.1:1234",
        2,
        1,
        False,
    )
    assert DistributedConfig.from_env(env, process_id=0).is_leader  # flags win over the env
    assert DistributedConfig.from_env({}) is None
    with pytest.raises(ValueError, match="without a coordinator"):
        DistributedConfig.from_env({"TOKENSPEED_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match="needs"):
        DistributedConfig.from_env({"TOKENSPEED_COORDINATOR": "h:1"})
    with pytest.raises(ValueError, match="HOST:PORT"):
        DistributedConfig("nohost", 2, 0)
    with pytest.raises(ValueError, match="process_id"):
        DistributedConfig("h:1", 2, 2)
    with pytest.raises(ValueError, match="integers"):
        DistributedConfig.from_env(dict(env, TOKENSPEED_NUM_PROCESSES="two"))
    assert resolve(None) is None
    assert resolve({"coordinator": "h:1", "num_processes": 2, "process_id": 0}).is_leader
    with pytest.raises(ValueError, match="distributed must be"):
        resolve(42)


def test_cli_flags():
    p = argparse.ArgumentParser()
    add_engine_args(p, num_pages=None)  # the parallel sizes are engine options
    args = p.parse_args(
        [
            "--coordinator",
            "127.0.0.1:9",
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "--tensor-parallel-size",
            "4",
            "--follower-timeout",
            "5",
        ]
    )
    cfg = distributed_config(args)
    assert (cfg.num_processes, cfg.process_id, cfg.follower_timeout_s) == (2, 1, 5.0)
    assert args.tensor_parallel_size == 4 and args.data_parallel_size == 1
    assert distributed_config(p.parse_args([])) is None
    # the launch flags alone (add_distributed_args) carry no engine option
    q = argparse.ArgumentParser()
    add_distributed_args(q)
    assert not hasattr(q.parse_args([]), "tensor_parallel_size")


class _FakeKV:
    """The coordination service's key-value calls the liveness threads use."""

    def __init__(self):
        self.store = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.store[key] = value

    def key_value_try_get(self, key):
        if key not in self.store:
            raise KeyError(key)
        return self.store[key]


def test_liveness_declares_a_silent_follower_lost():
    """Driven by hand on a fake clock: no sleeps, so thread scheduling cannot decide it."""
    kv = _FakeKV()
    lost = []
    now = [0.0]
    fast = dict(coordinator="h:1", num_processes=2, follower_timeout_s=0.6, heartbeat_interval_s=0.05)
    follower = Liveness(DistributedConfig(process_id=1, **fast), client=kv, start=False)
    leader = Liveness(
        DistributedConfig(process_id=0, **fast),
        client=kv,
        on_lost=lost.append,
        clock=lambda: now[0],
        start=False,
    )
    for _ in range(20):  # 1.0 s of beats every 0.05 s: a beating follower is never lost
        now[0] += 0.05
        assert follower.beat_once()
        assert leader.check_followers(now[0])
    assert not lost, "a beating follower must not be declared lost"
    now[0] += 0.6  # silent for exactly the timeout: still alive
    assert leader.check_followers(now[0]) and not lost
    now[0] += 0.05  # past the timeout: lost
    assert not leader.check_followers(now[0])
    assert lost and "follower process 1 of 2 stopped responding" in lost[0]
    with pytest.raises(RuntimeError, match="stopped responding"):
        leader.check()
    leader.stop()
    follower.stop()


def test_liveness_threads_beat_and_watch():
    """The same ticks on their real threads: the follower's counter moves, the leader reports
    the follower lost once it stops (a deadline poll that fails loudly, no fixed sleep)."""
    import time

    kv = _FakeKV()
    lost = []
    fast = dict(coordinator="h:1", num_processes=2, follower_timeout_s=0.3, heartbeat_interval_s=0.02)
    follower = Liveness(DistributedConfig(process_id=1, **fast), client=kv)
    key = "tokenspeed_jax/heartbeat/1"
    deadline = time.monotonic() + 10
    while int(kv.store.get(key, "0")) < 3:
        assert time.monotonic() < deadline, "the follower's heartbeat thread never beat"
        time.sleep(0.01)
    leader = Liveness(DistributedConfig(process_id=0, **fast), client=kv, on_lost=lost.append)
    follower.stop()
    deadline = time.monotonic() + 10
    while not lost:
        assert time.monotonic() < deadline, "the watchdog never declared the silent follower lost"
        time.sleep(0.02)
    assert "follower process 1 of 2" in lost[0]
    leader.stop()


class _Dev:
    def __init__(self, process_index: int, id: int):
        self.process_index, self.id = process_index, id

    def __repr__(self):
        return f"d{self.process_index}.{self.id}"


@pytest.fixture
def two_processes(monkeypatch):
    """jax as seen by a process of a 2-process x 2-device run (device ids as jax numbers them)."""
    devices = [_Dev(p, p * 2048 + i) for p in (1, 0) for i in (1, 0)]  # unordered on purpose
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "devices", lambda *a: devices)


def test_global_device_grid_spans_every_process(two_processes):
    from tokenspeed_jax.runtime.sharding import global_device_grid

    ids = lambda grid: [[(d.process_index, d.id) for d in row] for row in grid]  # noqa: E731
    assert ids(global_device_grid(4, 1)) == [[(0, 0), (0, 1), (1, 2048), (1, 2049)]]
    assert ids(global_device_grid(2, 2)) == [[(0, 0), (1, 2048)], [(0, 1), (1, 2049)]]
    assert ids(global_device_grid(2, 1)) == [[(0, 0), (1, 2048)]]
    with pytest.raises(ValueError, match="multiple of the 2 processes"):
        global_device_grid(1, 4)
    with pytest.raises(ValueError, match="exceeds the 4 available"):
        global_device_grid(4, 2)
