"""Leader / follower stepping of a multi-process run (see `tokenspeed_jax.distributed`).

Per step, on the leader (process 0, which owns the scheduler):
  1. pack the step's inputs into one int32 buffer (`distributed_ops`), prefix a header
     `[MAGIC, control, seq, replica, bucket, refresh, small_words, row_words]` (the refresh rows,
     which scale with the context capacity, follow as a second buffer only on refresh steps);
  2. broadcast it to every process: a jitted all-reduce over a ("proc", "local") mesh of all
     devices, where only the leader's row is non-zero (what `multihost_utils.broadcast_one_to_all`
     does, kept compiled for one fixed buffer size, so it is one collective per step);
  3. every process builds the same global replicated input array from the buffer (no
     cross-process equality check, unlike `jax.device_put`) and calls the same jitted step on its
     replica's mesh; the sampled ids come out replicated, so the leader reads them locally.
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

from tokenspeed_jax.distributed import DistributedConfig, Liveness
from tokenspeed_jax.distributed_ops import host_inputs, layout_of, pack, unpack
from tokenspeed_jax.runner import ModelRunner, StepResult

logger = logging.getLogger(__name__)

MAGIC = 0x7A5E_D157
STEP, SHUTDOWN, NOOP = 1, 2, 3  # NOOP: a bare broadcast (keep-alive, benchmarks)
HEADER = 8


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
            local[0, :len(buf)] = buf
        out = self._bcast(jax.make_array_from_callback(self._shape, self._rows, lambda idx: local))
        # finished on every local device before the step's collectives start (see "Ordering")
        out.block_until_ready()
        if self.is_source:
            return local[0]  # the leader knows the value; its copy of the result is not needed
        return np.asarray(out.addressable_data(0))


class DistributedGroup:
    """The channel, the ordering lock, the step counter, the keep-alive and (leader) the
    watchdog, shared by every replica."""

    def __init__(self, cfg: DistributedConfig, payload_words: tuple[int, int]) -> None:
        self.cfg = cfg
        small_words, row_words = payload_words
        # Two fixed sizes: every message uses the small channel (header + one step's inputs);
        # the i32[R, W_g] refresh rows, which scale with the context capacity, follow on their
        # own channel only when the header says the step carries a full refresh.
        self.channel = OpsChannel(HEADER + small_words)
        self.rows_channel = OpsChannel(max(1, row_words))
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
                    self.send(NOOP)
                    self.noops += 1
                except Exception:  # a follower died under it: the watchdog reports and exits
                    self.broken = True
                    return

    def send(self, control: int, replica: int = 0, bucket: int = 0, refresh: bool = False,
             small: np.ndarray | None = None, rows: np.ndarray | None = None) -> None:
        """Leader only; call with `lock` held."""
        if self.closed:
            raise RuntimeError("the distributed group is shut down")
        small = np.zeros(0, np.int32) if small is None else small
        rows = np.zeros(0, np.int32) if rows is None else rows
        header = np.array([MAGIC, control, self.seq, replica, bucket, int(refresh), len(small),
                           len(rows)], np.int32)
        self.channel.broadcast(np.concatenate([header, small]))
        if refresh:
            self.rows_channel.broadcast(rows)
        self.seq += 1
        self._last_send = time.monotonic()

    def recv(self) -> tuple[dict, np.ndarray, np.ndarray]:
        """Follower only: the next message (header fields, small buffer, refresh rows)."""
        buf = self.channel.broadcast(None)
        magic, control, seq, replica, bucket, refresh, n_small, n_rows = (int(x) for x in buf[:HEADER])
        if magic != MAGIC or seq != self.seq:
            raise RuntimeError(f"follower {self.cfg.process_id} out of sync with the leader: "
                               f"magic {magic:#x}, step {seq}, expected step {self.seq}")
        self.seq += 1
        small = buf[HEADER:HEADER + n_small]
        rows = self.rows_channel.broadcast(None)[:n_rows] if refresh else buf[:0]
        return (dict(control=control, replica=replica, bucket=bucket, refresh=bool(refresh)),
                small, rows)

    def shutdown(self) -> None:
        """Leader: tell the followers to exit (once); both sides: stop the liveness thread."""
        with self.lock:
            if self.cfg.is_leader and not self.closed and not self.broken:
                self.send(SHUTDOWN)
            self.closed = True
        self._stop.set()
        if self.liveness is not None:
            self.liveness.stop()


class DistributedRunner:
    """Wraps a `ModelRunner` whose mesh spans every process; same `step` / `warmup` interface
    (Engine drives it on the leader), `execute` replays a received step on a follower.
    Other attributes (params, state, num_compiles, ...) are the wrapped runner's."""

    def __init__(self, runner: ModelRunner, group: DistributedGroup, replica: int,
                 padding_ops) -> None:
        if runner._tp is None:
            raise ValueError("a multi-process runner needs a mesh (tensor_parallel_size >= 1 "
                             "over the global devices)")
        self.runner = runner
        self.group = group
        self.replica = replica
        self._rep = runner._tp.replicated
        self._layouts = {b: layout_of(host_inputs(padding_ops, b)) for b in runner.buckets}
        self._row_shapes = [tuple(np.shape(g.rows)) for g in padding_ops.groups]
        self._zero_rows = tuple(global_array(np.zeros(s, np.int32), self._rep)
                                for s in self._row_shapes)
        self._state_sh = jax.tree.map(lambda x: x.sharding, runner.state)
        self._fns: dict[int, object] = {}

    @staticmethod
    def payload_words(runner: ModelRunner, padding_ops) -> tuple[int, int]:
        """(words of the top bucket's inputs, words of every group's refresh rows)."""
        small = layout_of(host_inputs(padding_ops, runner.buckets[-1])).size
        return small, sum(int(np.prod(np.shape(g.rows))) for g in padding_ops.groups)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    # ------------------------------------------------------------------ every process
    def _fn(self, bucket: int):
        fn = self._fns.get(bucket)
        if fn is None:
            layout, runner = self._layouts[bucket], self.runner

            def step(params, state, buf, rows):
                ops = unpack(buf, layout)
                for g, r in zip(ops["groups"], rows, strict=True):
                    g["rows"] = r
                return runner._step_impl(params, state, ops)

            rep = self._rep
            fn = self._fns[bucket] = jax.jit(step, donate_argnums=(1,),
                                             out_shardings=(self._state_sh, rep, rep, rep))
        return fn

    def execute(self, bucket: int, refresh: bool, small: np.ndarray, rows: np.ndarray):
        """Dispatch one step on this process's devices (async); returns the device outputs."""
        if refresh:
            parts, off = [], 0
            for shape in self._row_shapes:
                n = int(np.prod(shape))
                parts.append(global_array(rows[off:off + n].reshape(shape), self._rep))
                off += n
            row_arrays = tuple(parts)
        else:
            row_arrays = self._zero_rows
        r = self.runner
        r.state, tokens, logprobs, plp = self._fn(bucket)(
            r.params, r.state, global_array(small, self._rep), row_arrays)
        return tokens, logprobs, plp

    # ------------------------------------------------------------------ leader
    def _lead(self, ops, bucket: int):
        refresh = bool(np.asarray(ops.full_refresh).any())
        small = pack(host_inputs(ops, bucket), self._layouts[bucket])
        rows = (np.concatenate([np.asarray(g.rows, np.int32).reshape(-1) for g in ops.groups])
                if refresh else None)
        group = self.group
        with group.lock:
            group.liveness.check()
            if group.broken:
                raise RuntimeError("an earlier collective failed; the distributed run is unusable")
            try:
                group.send(STEP, self.replica, bucket, refresh, small, rows)
                return jax.block_until_ready(self.execute(bucket, refresh, small, rows))
            except Exception as e:
                # usually a follower died under the collective: wait for the watchdog's verdict
                # (its default handler exits the process with the clear message)
                group.broken = True
                lost = group.liveness.wait_for_verdict()
                if lost is not None:
                    raise RuntimeError(lost) from e
                raise

    def step(self, ops) -> StepResult:
        """Leader: broadcast `ops` and run it everywhere; returns host results (as ModelRunner)."""
        r = self.runner
        if ops.num_reqs == 0:
            return r.step(ops)  # empty steps never reach the device (nor the followers)
        r._warn_clamped(ops)
        bucket = r.bucket_for(int(ops.num_tokens))
        tokens, logprobs, plp = self._lead(ops, bucket)
        plp_full = np.full(r.max_scheduled_tokens, np.nan, np.float32)
        plp_full[:bucket] = np.asarray(plp)
        return StepResult(np.asarray(tokens), np.asarray(logprobs), plp_full)

    def warmup(self, padding_ops) -> int:
        """Leader: compile every bucket on every process with all-padding steps."""
        if padding_ops.num_reqs:
            raise ValueError(f"warmup needs an all-padding StepOps, got {padding_ops.num_reqs} rows")
        before = self.runner.num_compiles
        for bucket in self.runner.buckets:
            self._lead(padding_ops, bucket)
        return self.runner.num_compiles - before


def follow(group: DistributedGroup, runners: list[DistributedRunner]) -> int:
    """Follower main loop: replay the leader's steps until SHUTDOWN; returns the steps run."""
    steps = 0
    try:
        while True:
            head, small, rows = group.recv()
            if head["control"] == SHUTDOWN:
                break
            if head["control"] == NOOP:
                group.noops += 1
                continue
            if head["control"] != STEP:
                raise RuntimeError(f"unknown control word {head['control']} from the leader")
            outs = runners[head["replica"]].execute(head["bucket"], head["refresh"], small, rows)
            jax.block_until_ready(outs)  # see "Ordering" in the module docstring
            steps += 1
        for r in runners:
            jax.block_until_ready(r.runner.state)
    finally:
        group.closed = True
    return steps
