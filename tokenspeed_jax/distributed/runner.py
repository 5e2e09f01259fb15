"""Leader / follower stepping of a multi-process run (see `tokenspeed_jax.distributed.launch`).

Per step, on the leader (process 0, which owns the scheduler):
  1. pack the step's inputs exactly as the single-process runner does (`step_inputs.pack`: one
     int32 + one float32 buffer for the step's shape key = token bucket x kv bucket) and frame
     them as ONE int32 message `[MAGIC, control, seq, replica, bucket, kv_level, n_i32, n_f32]
     + i32 + f32 bits`;
  2. send it to every process through the coordination service's key-value store
     (`KVChannel`: one key per follower and message, deleted by its reader);
  3. every process builds the same global replicated input arrays from the buffers (no
     cross-process equality check, unlike `jax.device_put`) and dispatches the runner's own
     jitted step on its replica's mesh without waiting for it; the sampled ids come out
     replicated, so the leader reads them locally when the engine collects the step.
Followers loop on 2-3 until the control word says SHUTDOWN. They hold no request state: admissions
and aborts are already folded into the StepOps by the leader's scheduler, so the control word
(STEP / SHUTDOWN / NOOP), the step counter and the replica index are all that travels besides the ops.

Ordering: every collective program must be dispatched in the same order on every process. One
lock covers "send + dispatch" on the leader and followers dispatch in message order, so
data-parallel replicas stepped from several leader threads stay consistent. Steps are not waited
for: the replicas of a dp run live on disjoint device sets (disjoint gloo / NCCL cliques), and
their programs run at the same time correctly (measured; docs/distributed.md), so replica 1's
step overlaps replica 0's. What must never overlap a step is a collective over a device set that
shares processes with it: an earlier version broadcast the ops with a jitted all-reduce over all
devices, and a broadcast running while a step ran on the same gloo connections failed with
"Received data size doesn't match expected size ... collective mismatch". That is why the
messages go through the key-value store (gRPC, off the devices), and why replicas used to take
turns.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, NoReturn

import jax
import numpy as np
from jax.sharding import NamedSharding

from scheduler import StepOps
from scheduler.cache_layout import CacheLayout
from tokenspeed_jax.distributed.launch import DistributedConfig, Liveness
from tokenspeed_jax.runtime.runner import ModelRunner
from tokenspeed_jax.runtime.shapes import ShapePolicy, StepShape
from tokenspeed_jax.runtime.state import DeviceState
from tokenspeed_jax.runtime.step_inputs import pack
from tokenspeed_jax.runtime.step_outputs import StepHandle, StepOutputs, StepResult

logger = logging.getLogger(__name__)

MAGIC = 0x7A5E_D157
STEP, SHUTDOWN, NOOP = 1, 2, 3  # NOOP: a bare broadcast (keep-alive, benchmarks)
HEADER = 8


def frame(
    control: int,
    seq: int,
    replica: int = 0,
    bucket: int = 0,
    level: int = 0,
    i32: np.ndarray | None = None,
    f32: np.ndarray | None = None,
) -> np.ndarray:
    """One int32 message: the 8-word header, the i32 buffer, the f32 buffer's bits."""
    i32 = np.zeros(0, np.int32) if i32 is None else np.asarray(i32, np.int32)
    f32 = np.zeros(0, np.float32) if f32 is None else np.asarray(f32, np.float32)
    header = np.array([MAGIC, control, seq, replica, bucket, level, i32.size, f32.size], np.int32)
    return np.concatenate([header, i32, f32.view(np.int32)])


def unframe(msg: np.ndarray) -> tuple[dict, np.ndarray, np.ndarray]:
    """Inverse of `frame` (trailing padding ignored)."""
    magic, control, seq, replica, bucket, level, n_i, n_f = (int(x) for x in msg[:HEADER])
    if magic != MAGIC:
        raise RuntimeError(f"bad message from the leader (magic {magic:#x})")
    i32 = msg[HEADER : HEADER + n_i]
    f32 = msg[HEADER + n_i : HEADER + n_i + n_f].view(np.float32)
    return dict(control=control, seq=seq, replica=replica, bucket=bucket, level=level), i32, f32


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array whose addressable shards are cut from `host` (the same value on every
    process). Unlike `jax.device_put` onto a sharding that spans processes, this runs no
    cross-process equality check (a full broadcast + compare of the value)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


_GROUPS = itertools.count()  # every process creates its groups in the same order


class KVChannel:
    """Leader -> followers messages through the coordination service's key-value store: the
    leader writes message `seq` under one key per follower, each follower blocks on its key and
    deletes it. No device program runs, so a message never waits for (or interleaves with) the
    steps still running on the devices; see "Ordering" in the module docstring."""

    _POLL_MS = 60_000  # a follower's blocking get re-arms after this (the leader may be idle)

    def __init__(self, client, process_id: int, num_processes: int) -> None:
        self._client, self.pid, self.nproc = client, process_id, num_processes
        self._prefix = f"tokenspeed/ops/{next(_GROUPS)}"
        self._seq = 0

    def broadcast(self, buf: np.ndarray | None) -> np.ndarray:
        """Leader passes its message (any size); followers pass None and get the next one."""
        seq, self._seq = self._seq, self._seq + 1
        if self.pid == 0:
            data = np.ascontiguousarray(buf, np.int32).tobytes()
            for k in range(1, self.nproc):
                self._client.key_value_set_bytes(f"{self._prefix}/{k}/{seq}", data)
            return np.asarray(buf, np.int32)
        key = f"{self._prefix}/{self.pid}/{seq}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, self._POLL_MS)
                break
            except Exception as e:  # deadline exceeded: keep waiting (the leader is alive or
                if "DEADLINE" not in str(e).upper():  # the runtime terminates this process)
                    raise
        self._client.key_value_delete(key)
        return np.frombuffer(data, np.int32).copy()


class DistributedGroup:
    """The channels, the ordering lock, the step counter, the keep-alive and (leader) the
    watchdog, shared by every replica."""

    def __init__(self, cfg: DistributedConfig, message_words: tuple[int, int]) -> None:
        from tokenspeed_jax.distributed.launch import _client

        self.cfg = cfg
        self.max_words = max(HEADER, *message_words)  # the largest step's message
        self.channel = KVChannel(_client(), cfg.process_id, cfg.num_processes)
        self.lock = threading.Lock()
        # leader, dp overlap evidence: each replica's latest step output, and how many steps
        # were dispatched while another replica's step was still computing
        self.running: dict[int, jax.Array] = {}
        self.overlapped = 0
        # leader: the watchdog over the followers' heartbeats (which run per process)
        self.liveness = Liveness(cfg) if cfg.is_leader else None
        self.seq = 0
        self.closed = False
        self.broken = False  # a collective failed: nothing more may be broadcast
        self.noops = 0  # keep-alive messages sent (leader) / received (follower)
        self._last_send = time.monotonic()
        self._stop = threading.Event()
        if cfg.is_leader:
            threading.Thread(target=self._keepalive, name="tokenspeed-keepalive", daemon=True).start()

    def _keepalive(self) -> None:
        """Leader: an empty broadcast after `keepalive_s` without a message (see the config)."""
        period = self.cfg.keepalive_s
        while not self._stop.wait(period / 2):
            with self.lock:
                if self.closed or self.broken:
                    return
                if time.monotonic() - self._last_send < period:
                    continue
                try:
                    self.send(frame(NOOP, self.seq))
                    self.noops += 1
                except Exception:  # a follower died under it: the watchdog reports and exits
                    self.broken = True
                    return

    def send(self, msg: np.ndarray) -> None:
        """Leader only; call with `lock` held. `msg` from `frame(..., seq=self.seq)`."""
        if self.closed:
            raise RuntimeError("the distributed group is shut down")
        if msg.size > self.max_words:
            raise RuntimeError(f"step message of {msg.size} words exceeds {self.max_words}")
        self.channel.broadcast(msg)
        self.seq += 1
        self._last_send = time.monotonic()

    def recv(self) -> tuple[dict, np.ndarray, np.ndarray]:
        """Follower only: the next message (header fields, i32 buffer, f32 buffer)."""
        head, i32, f32 = unframe(self.channel.broadcast(None))
        if head["seq"] != self.seq:
            raise RuntimeError(
                f"follower {self.cfg.process_id} out of sync with the leader: "
                f"step {head['seq']}, expected step {self.seq}"
            )
        self.seq += 1
        return head, i32, f32

    def shutdown(self) -> None:
        """Leader: tell the followers to exit (once); both sides: stop the threads."""
        with self.lock:
            if self.cfg.is_leader and not self.closed and not self.broken:
                self.send(frame(SHUTDOWN, self.seq))
            self.closed = True
        self._stop.set()
        if self.liveness is not None:
            self.liveness.stop()


class DistributedRunner:
    """Wraps a `ModelRunner` whose mesh spans every process. On the leader it is the engine's
    `engine.Runner` (dispatch / collect / warmup / host_mirrors broadcast every step to the
    followers); on a follower `execute` replays a received step. The read-only views below
    (`shapes`, `state`, `params`, ...) are the wrapped runner's."""

    def __init__(self, runner: ModelRunner, group: DistributedGroup, replica: int) -> None:
        tp = runner.tp
        if tp is None:
            raise ValueError(
                "a multi-process runner needs a mesh (tensor_parallel_size >= 1 over the global devices)"
            )
        self.runner = runner
        self.group = group
        self.replica = replica
        self.layout: CacheLayout = runner.layout  # a setup value: the runner's, never reassigned
        self._rep = tp.replicated

    @staticmethod
    def message_words(runner: ModelRunner) -> tuple[int, int]:
        """(words of the largest step of the shortest kv bucket, of the largest step at all)."""
        shapes = runner.shapes

        def words(level: int) -> int:
            lay = runner.step_layout(StepShape(shapes.buckets[-1], level))
            return HEADER + lay.i32_size + lay.f32_size

        return words(0), words(len(shapes.kv_levels) - 1)

    # ------------------------------------------------------------------ the wrapped runner's
    @property
    def num_compiles(self) -> int:
        """Step compilations so far on this process (`ModelRunner.num_compiles`)."""
        return self.runner.num_compiles

    @property
    def shapes(self) -> ShapePolicy:
        return self.runner.shapes

    @property
    def shape_keys(self) -> tuple[tuple[int, int], ...]:
        return self.runner.shape_keys

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.runner.buckets

    @property
    def backend(self) -> str:
        return self.runner.backend

    @property
    def state(self) -> DeviceState:
        return self.runner.state

    @property
    def params(self) -> Any:  # the nnx.State of the model, sharded over the global mesh
        return self.runner.params

    def host_mirrors(self) -> list[np.ndarray]:
        """The device page-table mirrors after the last dispatched step (debug checks)."""
        return self.runner.host_mirrors()

    # ------------------------------------------------------------------ every process
    def execute(self, shape: StepShape, i32: np.ndarray, f32: np.ndarray) -> StepOutputs:
        """Dispatch one step on this process's devices (async); returns the device outputs.
        i32 / f32: the step's packed buffers (`ModelRunner.execute`), the same on every process."""
        layout = self.runner.step_layout(shape)
        if (i32.size, f32.size) != (layout.i32_size, layout.f32_size):
            raise RuntimeError(
                f"step buffers of {i32.size}/{f32.size} words do not match the "
                f"layout of bucket {shape.bucket}, kv level {shape.level}"
            )
        i32_dev, f32_dev = (global_array(np.ascontiguousarray(b), self._rep) for b in (i32, f32))
        return self.runner.execute(shape, i32_dev, f32_dev)

    # ------------------------------------------------------------------ leader
    def _lead(self, ops: StepOps, shape: StepShape) -> StepOutputs:
        group, liveness = self.group, self.group.liveness
        if liveness is None:
            raise RuntimeError("only the leader runs steps (it owns the watchdog)")
        i32, f32 = pack(ops, self.runner.step_layout(shape))
        with group.lock:
            liveness.check()
            if group.broken:
                raise RuntimeError("an earlier collective failed; the distributed run is unusable")
            try:
                group.send(frame(STEP, group.seq, self.replica, shape.bucket, shape.level, i32, f32))
                # dispatched, not waited for: another replica's step may run meanwhile
                return self.execute(shape, i32, f32)
            except Exception as e:
                self._fail(e)

    def _fail(self, e: Exception) -> NoReturn:
        """A step failed, usually because a follower died under its collective: wait for the
        watchdog's verdict (its default handler exits the process with the clear message)."""
        self.group.broken = True
        liveness = self.group.liveness
        lost = liveness.wait_for_verdict() if liveness is not None else None
        if lost is not None:
            raise RuntimeError(lost) from e
        raise e

    # structured outputs' token masks are not broadcast to the followers (yet): the engine
    # refuses constrained requests on this runtime instead of running them unconstrained
    supports_token_mask = False
    programs = None  # the executables live in the wrapped runner; no per-shape record here

    def dispatch(self, ops: StepOps, token_mask: np.ndarray | None = None) -> StepHandle:
        """Leader: broadcast `ops` and run it everywhere (blocks until every process ran it, so a
        dead follower surfaces here); returns the runner's `StepHandle`. Defined here, not left
        to the wrapped runner, so the overlapped engine loop broadcasts too."""
        if token_mask is not None:
            raise ValueError(
                "token masks (structured outputs) are not supported on the multi-process runtime"
            )
        r = self.runner
        if ops.num_seqs == 0:
            return r.dispatch(ops)  # empty steps never reach the device (nor the followers)
        r.warn_clamped(ops)
        shape = r.shapes.step_shape(ops)
        outs = self._lead(ops, shape)
        group = self.group
        with group.lock:
            # another replica's step still computing while this one starts: device overlap
            if any(
                not a.is_ready()  # type: ignore[attr-defined]  # jax.Array stubs lack is_ready
                for rep, a in group.running.items()
                if rep != self.replica
            ):
                group.overlapped += 1
            group.running[self.replica] = outs[0]
        return r.handle_for(ops, shape.bucket, *outs)

    def collect(self, handle: StepHandle) -> StepResult:
        """Leader: the host results of a dispatched step (waits for it on every process)."""
        try:
            return self.runner.collect(handle)
        except Exception as e:
            self._fail(e)

    def step(self, ops: StepOps) -> StepResult:
        """Leader: one step on every process; host results as `ModelRunner.step`."""
        return self.collect(self.dispatch(ops))

    def warmup(
        self, padding_ops: StepOps, max_kv_len: int | None = None, *, progress: bool = False, workers: int = 1
    ) -> int:
        """Leader: compile the shape keys on every process with all-padding steps (the policy of
        `ModelRunner.warmup`: `ShapePolicy.warmup_shapes`), one at a time so every process
        compiles the same shape in the same order (`progress`, `workers`: ignored)."""
        shapes = self.runner.shapes.warmup_shapes(padding_ops, max_kv_len)
        before = self.runner.num_compiles
        for shape in shapes:
            jax.block_until_ready(self._lead(padding_ops, shape))
        return self.runner.num_compiles - before


def follow(group: DistributedGroup, runners: list[DistributedRunner]) -> int:
    """Follower main loop: replay the leader's steps until SHUTDOWN; returns the steps run."""
    steps = 0
    try:
        while True:
            head, i32, f32 = group.recv()
            if head["control"] == SHUTDOWN:
                break
            if head["control"] == NOOP:
                group.noops += 1
                continue
            if head["control"] != STEP:
                raise RuntimeError(f"unknown control word {head['control']} from the leader")
            # dispatched, not waited for (see "Ordering"): the next message may be another
            # replica's step, which then runs alongside this one
            runners[head["replica"]].execute(StepShape(head["bucket"], head["level"]), i32, f32)
            steps += 1
        for r in runners:
            jax.block_until_ready(r.runner.state)
    finally:
        group.closed = True
    return steps
