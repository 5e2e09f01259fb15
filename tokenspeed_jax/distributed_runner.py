"""Leader / follower stepping of a multi-process run (see `tokenspeed_jax.distributed`).

Per step, on the leader (process 0, which owns the scheduler):
  1. pack the step's inputs exactly as the single-process runner does (`step_inputs.pack`: one
     int32 + one float32 buffer for the step's shape key = token bucket x kv bucket) and frame
     them as ONE int32 message `[MAGIC, control, seq, replica, bucket, kv_level, n_i32, n_f32]
     + i32 + f32 bits`;
  2. broadcast it to every process: a jitted all-reduce over a ("proc", "local") mesh of all
     devices, where only the leader's row is non-zero (what `multihost_utils.broadcast_one_to_all`
     does, kept compiled for fixed sizes: a small channel that fits every step of the shortest
     kv bucket, and a full-size one announced by the small one only for longer steps);
  3. every process builds the same global replicated input arrays from the buffers (no
     cross-process equality check, unlike `jax.device_put`) and calls the runner's own jitted step
     on its replica's mesh; the sampled ids come out replicated, so the leader reads them locally.
Followers loop on 2-3 until the control word says SHUTDOWN. They hold no request state: admissions
and aborts are already folded into the StepOps by the leader's scheduler, so the control word
(STEP / SHUTDOWN / NOOP), the step counter and the replica index are all that travels besides the ops.

Ordering: every collective program must run in the same order on every process. One lock covers
"broadcast + step" on the leader, and followers run in broadcast order, so data-parallel replicas
stepped from several leader threads stay consistent. Each step is also waited for before the next
broadcast: the replicas of a dp run live on disjoint device sets, and two collective programs
running at once on disjoint devices of the same processes share the gloo connections between the
processes and corrupt each other ("collective mismatch"; the broadcast, over all devices, is
waited for too). So multi-process dp replicas take turns (no overlap between replicas); tp within
a replica is unaffected.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from scheduler import StepOps
from tokenspeed_jax.distributed import DistributedConfig, Liveness
from tokenspeed_jax.runner import ModelRunner, StepHandle, StepOutputs, StepResult
from tokenspeed_jax.step_inputs import pack

logger = logging.getLogger(__name__)

MAGIC = 0x7A5E_D157
STEP, SHUTDOWN, NOOP = 1, 2, 3  # NOOP: a bare broadcast (keep-alive, benchmarks)
HEADER = 8
_BIG = 1 << 30  # header flag (in the control word): the message follows on the full-size channel


def frame(control: int, seq: int, replica: int = 0, bucket: int = 0, level: int = 0,
          i32: np.ndarray | None = None, f32: np.ndarray | None = None) -> np.ndarray:
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
    i32 = msg[HEADER:HEADER + n_i]
    f32 = msg[HEADER + n_i:HEADER + n_i + n_f].view(np.float32)
    return dict(control=control, seq=seq, replica=replica, bucket=bucket, level=level), i32, f32


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array whose addressable shards are cut from `host` (the same value on every
    process). Unlike `jax.device_put` onto a sharding that spans processes, this runs no
    cross-process equality check (a full broadcast + compare of the value)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


class OpsChannel:
    """Fixed-size int32 broadcast from process 0 to every process, over all devices."""

    def __init__(self, words: int) -> None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        nproc = jax.process_count()
        mesh = Mesh(np.array(devices).reshape(nproc, -1), ("proc", "local"))
        self.words = int(words)
        self.is_source = jax.process_index() == 0
        self._rows = NamedSharding(mesh, P("proc"))
        self._shape = (nproc, self.words)
        # sum over processes of (leader's buffer, zeros...) == the leader's buffer, replicated
        self._bcast = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(mesh, P()))

    def broadcast(self, buf: np.ndarray | None) -> np.ndarray:
        """Leader passes its buffer (<= words, zero-padded); followers pass None and get it."""
        local = np.zeros((1, self.words), np.int32)
        if self.is_source:
            if buf is None:
                raise ValueError("the leader must pass the buffer it broadcasts")
            local[0, :len(buf)] = buf
        out = self._bcast(jax.make_array_from_callback(self._shape, self._rows, lambda idx: local))
        # finished on every local device before the step's collectives start (see "Ordering")
        out.block_until_ready()
        if self.is_source:
            return local[0]  # the leader knows the value; its copy of the result is not needed
        return np.asarray(out.addressable_data(0))


class DistributedGroup:
    """The channels, the ordering lock, the step counter, the keep-alive and (leader) the
    watchdog, shared by every replica."""

    def __init__(self, cfg: DistributedConfig, message_words: tuple[int, int]) -> None:
        self.cfg = cfg
        small_words, full_words = message_words
        # Fixed sizes (one compile each): every message starts on the small channel; one that
        # does not fit (a long-context step: its page-table rows scale with the kv bucket) is
        # announced there and follows on the full-size channel.
        self.channel = OpsChannel(max(HEADER, small_words))
        self.big_channel = OpsChannel(full_words) if full_words > small_words else None
        self.lock = threading.Lock()
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
        if msg.size <= self.channel.words:
            self.channel.broadcast(msg)
        elif self.big_channel is None:
            raise RuntimeError(f"a {msg.size}-word message exceeds every channel")
        else:
            announce = msg[:HEADER].copy()
            announce[1] |= _BIG
            self.channel.broadcast(announce)
            self.big_channel.broadcast(msg)
        self.seq += 1
        self._last_send = time.monotonic()

    def recv(self) -> tuple[dict, np.ndarray, np.ndarray]:
        """Follower only: the next message (header fields, i32 buffer, f32 buffer)."""
        msg = self.channel.broadcast(None)
        if int(msg[1]) & _BIG:
            if self.big_channel is None:
                raise RuntimeError("the leader announced a message larger than every channel")
            msg = self.big_channel.broadcast(None)
        head, i32, f32 = unframe(msg)
        if head["seq"] != self.seq:
            raise RuntimeError(f"follower {self.cfg.process_id} out of sync with the leader: "
                               f"step {head['seq']}, expected step {self.seq}")
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
    """Wraps a `ModelRunner` whose mesh spans every process; same `step` / `warmup` interface
    (Engine drives it on the leader), `execute` replays a received step on a follower.
    Other attributes (params, state, num_compiles, ...) are the wrapped runner's."""

    def __init__(self, runner: ModelRunner, group: DistributedGroup, replica: int) -> None:
        if runner._tp is None:
            raise ValueError("a multi-process runner needs a mesh (tensor_parallel_size >= 1 "
                             "over the global devices)")
        self.runner = runner
        self.group = group
        self.replica = replica
        self._rep = runner._tp.replicated

    @staticmethod
    def message_words(runner: ModelRunner) -> tuple[int, int]:
        """(words of the largest step of the shortest kv bucket, of the largest step at all)."""
        def words(cols):
            lay = runner._layout(runner.buckets[-1], cols)
            return HEADER + lay.i32_size + lay.f32_size

        return words(runner.kv_levels[0][1]), words(runner.kv_levels[-1][1])

    def __getattr__(self, name):
        return getattr(self.runner, name)

    # ------------------------------------------------------------------ every process
    def execute(self, bucket: int, level: int, i32: np.ndarray, f32: np.ndarray) -> StepOutputs:
        """Dispatch one step on this process's devices (async); returns the device outputs."""
        r = self.runner
        layout = r._layout(bucket, r.kv_levels[level][1])
        if (i32.size, f32.size) != (layout.i32_size, layout.f32_size):
            raise RuntimeError(f"step buffers of {i32.size}/{f32.size} words do not match the "
                               f"layout of bucket {bucket}, kv level {level}")
        bufs = [global_array(np.ascontiguousarray(b), self._rep) for b in (i32, f32)]
        r.state, r.penalties, tokens, logprobs, plp, top = r._step(
            r.param_leaves, r.state, r.penalties, *bufs, layout)
        return tokens, logprobs, plp, top

    # ------------------------------------------------------------------ leader
    def _lead(self, ops: StepOps, bucket: int, level: int) -> StepOutputs:
        r, group, liveness = self.runner, self.group, self.group.liveness
        if liveness is None:
            raise RuntimeError("only the leader runs steps (it owns the watchdog)")
        i32, f32 = pack(ops, r._layout(bucket, r.kv_levels[level][1]))
        with group.lock:
            liveness.check()
            if group.broken:
                raise RuntimeError("an earlier collective failed; the distributed run is unusable")
            try:
                group.send(frame(STEP, group.seq, self.replica, bucket, level, i32, f32))
                return jax.block_until_ready(self.execute(bucket, level, i32, f32))
            except Exception as e:
                # usually a follower died under the collective: wait for the watchdog's verdict
                # (its default handler exits the process with the clear message)
                group.broken = True
                lost = liveness.wait_for_verdict()
                if lost is not None:
                    raise RuntimeError(lost) from e
                raise

    def dispatch(self, ops: StepOps) -> StepHandle:
        """Leader: broadcast `ops` and run it everywhere (blocks until every process ran it, so a
        dead follower surfaces here); returns the runner's `StepHandle`. Defined here, not left
        to the wrapped runner, so the overlapped engine loop broadcasts too."""
        r = self.runner
        if ops.num_reqs == 0:
            return r.dispatch(ops)  # empty steps never reach the device (nor the followers)
        bucket, level = r.step_shape(ops)
        return r.handle_for(ops, bucket, *self._lead(ops, bucket, level))

    def step(self, ops: StepOps) -> StepResult:
        """Leader: one step on every process; host results as `ModelRunner.step`."""
        return self.runner.collect(self.dispatch(ops))

    def warmup(self, padding_ops, max_kv_len: int | None = None) -> int:
        """Leader: compile the shape keys on every process with all-padding steps (the same
        policy as `ModelRunner.warmup`: every kv level, or those up to `max_kv_len` tokens)."""
        if padding_ops.num_reqs:
            raise ValueError(f"warmup needs an all-padding StepOps, got {padding_ops.num_reqs} rows")
        levels = self.runner.kv_levels
        top = len(levels) - 1
        if max_kv_len is not None:
            if max_kv_len < 1:
                raise ValueError(f"max_kv_len must be >= 1, got {max_kv_len}")
            top = next((i for i, (t, _) in enumerate(levels) if t >= max_kv_len), top)
        before = self.runner.num_compiles
        for bucket in self.runner.buckets:
            for level in range(top + 1):
                self._lead(padding_ops, bucket, level)
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
            outs = runners[head["replica"]].execute(head["bucket"], head["level"], i32, f32)
            jax.block_until_ready(outs)  # see "Ordering" in the module docstring
            steps += 1
        for r in runners:
            jax.block_until_ready(r.runner.state)
    finally:
        group.closed = True
    return steps
