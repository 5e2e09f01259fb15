"""Multi-host serving on JAX's multi-controller runtime: launch config, initialization, liveness.

One process per host (or, on CPU, several local processes with gloo collectives), all joined by
`jax.distributed.initialize(coordinator, num_processes, process_id)`. Every process holds its
slice of a global mesh (`sharding.replica_meshes`), and every process calls the same jitted step
on globally sharded arrays. Process 0 (the *leader*) owns the scheduler, the requests and the
HTTP server; each step it broadcasts the StepOps to the *followers* (`distributed/runner.py`),
which hold no request state and only replay the steps.

Launch: `DistributedConfig(coordinator="HOST:PORT", num_processes=N, process_id=I)`, built from
the CLI flags `--coordinator --num-processes --process-id` or the environment
(`TOKENSPEED_COORDINATOR`, `TOKENSPEED_NUM_PROCESSES`, `TOKENSPEED_PROCESS_ID`).

Liveness: a follower that dies leaves the leader blocked inside a collective forever (gloo and
NCCL wait), so it must be detected from the side: every follower, from `initialize` on (so also
while it loads its shards), writes a heartbeat counter into the coordination service's key-value
store every `heartbeat_interval_s`; a watchdog thread on the leader reads them. A counter that
has not moved for `follower_timeout_s` means the follower is gone: the leader prints a clear
error and exits the process with `EXIT_FOLLOWER_LOST` (a step would block forever in a
collective, or fail inside gloo / NCCL, and even a clean interpreter exit would hang in jax's
shutdown barrier). A step whose collective fails waits for that verdict before re-raising.
JAX's own heartbeat timeout (which aborts with a terse log line) is set longer than ours, as a
backstop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "TOKENSPEED_COORDINATOR"
ENV_NUM_PROCESSES = "TOKENSPEED_NUM_PROCESSES"
ENV_PROCESS_ID = "TOKENSPEED_PROCESS_ID"
EXIT_FOLLOWER_LOST = 70  # EX_SOFTWARE: the leader cannot go on without a follower
_HEARTBEAT_KEY = "tokenspeed_jax/heartbeat/{}"
_HEARTBEAT: Liveness | None = None  # a follower's process-wide heartbeat (see `initialize`)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in a multi-process run.

    coordinator: "HOST:PORT" of process 0's coordination service (every process passes the same).
    num_processes: processes in the run (one per host on GPUs); process_id: this one, 0 = leader.
    follower_timeout_s: a follower silent this long is declared dead (leader fails loudly).
    heartbeat_interval_s: how often followers report and the leader's watchdog checks.
    keepalive_s: an idle leader sends an empty message this often, so a follower's blocking
      read of the next message returns regularly.
    initialization_timeout_s: how long `jax.distributed.initialize` waits for every process.
    """

    coordinator: str
    num_processes: int
    process_id: int
    follower_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.5
    keepalive_s: float = 10.0
    initialization_timeout_s: int = 300

    def __post_init__(self) -> None:
        host, sep, port = str(self.coordinator).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"coordinator must be HOST:PORT, got {self.coordinator!r}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.heartbeat_interval_s <= 0 or self.follower_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"follower_timeout_s ({self.follower_timeout_s}) must exceed twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) > 0"
            )
        if self.keepalive_s <= 0:
            raise ValueError(f"keepalive_s must be > 0, got {self.keepalive_s}")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> DistributedConfig | None:
        """Config from TOKENSPEED_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID; None when the
        coordinator is unset. `overrides` (non-None values) win over the environment."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {
            "coordinator": env.get(ENV_COORDINATOR),
            "num_processes": env.get(ENV_NUM_PROCESSES),
            "process_id": env.get(ENV_PROCESS_ID),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values["coordinator"] is None:
            given = [k for k in ("num_processes", "process_id") if values[k] is not None]
            if given:
                raise ValueError(
                    f"{given} given without a coordinator (--coordinator HOST:PORT or {ENV_COORDINATOR})"
                )
            return None
        missing = [k for k in ("num_processes", "process_id") if values[k] is None]
        if missing:
            raise ValueError(
                f"a multi-process launch needs {missing} (flags --num-processes / "
                f"--process-id or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})"
            )
        try:
            values["num_processes"] = int(values["num_processes"])
            values["process_id"] = int(values["process_id"])
        except ValueError:
            raise ValueError(
                f"num_processes and process_id must be integers, got "
                f"{values['num_processes']!r}, {values['process_id']!r}"
            ) from None
        return cls(**values)


def resolve(distributed) -> DistributedConfig | None:
    """`LLM(distributed=...)`: a DistributedConfig, a dict of its fields, "env" (read the
    environment) or None (single process)."""
    if distributed is None or isinstance(distributed, DistributedConfig):
        return distributed
    if distributed == "env":
        return DistributedConfig.from_env()
    if isinstance(distributed, Mapping):
        return DistributedConfig(**distributed)
    raise ValueError(
        f"distributed must be a DistributedConfig, a dict, 'env' or None, got {distributed!r:.80}"
    )


def _client():
    from jax._src import distributed as jd

    return jd.global_state.client


def initialize(cfg: DistributedConfig) -> None:
    """Join the multi-controller runtime (idempotent for the same config).

    CPU collectives use gloo (harmless on GPU hosts, where NCCL carries the collectives). Must run
    before anything touches `jax.devices()`."""
    import jax
    from jax._src import distributed as jd

    state = jd.global_state
    if state.client is not None:
        if (state.num_processes, state.process_id) != (cfg.num_processes, cfg.process_id):
            raise ValueError(
                f"jax.distributed is already initialized as process "
                f"{state.process_id}/{state.num_processes}, not {cfg.process_id}/"
                f"{cfg.num_processes}"
            )
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            cfg.coordinator, cfg.num_processes, cfg.process_id,
            initialization_timeout=int(cfg.initialization_timeout_s),
            # our watchdog (clear message) fires first; JAX's own detection stays as a backstop
            heartbeat_timeout_seconds=int(max(2 * cfg.follower_timeout_s, cfg.follower_timeout_s + 10)),
        )  # fmt: skip
    global _HEARTBEAT
    if not cfg.is_leader and _HEARTBEAT is None:
        # from now on, for the life of the runtime: the leader's watchdog must see this process
        # alive while it is still loading its shards, however long that takes
        _HEARTBEAT = Liveness(cfg)


def leave(cfg: DistributedConfig) -> None:
    """Stop this process's heartbeat (followers) and leave `jax.distributed` (a barrier with
    every other process)."""
    import jax

    global _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop()
        _HEARTBEAT = None
    jax.distributed.shutdown()


class Liveness:
    """A follower's heartbeat thread (one per process, started by `initialize`) or the leader's
    watchdog thread (one per `DistributedGroup`); see the module docstring.

    Each tick is a method (`beat_once` on a follower, `check_followers(now)` on the leader), so
    tests drive them by hand with `start=False` and their own `clock` instead of sleeping."""

    def __init__(
        self,
        cfg: DistributedConfig,
        *,
        on_lost: Callable[[str], None] | None = None,
        client=None,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        self.cfg = cfg
        self._client = client if client is not None else _client()
        self._clock = clock
        self._stop = threading.Event()
        self.lost: str | None = None  # the failure message once a follower is declared dead
        self._on_lost = on_lost or self._default_on_lost
        self._beats = 0
        followers = range(1, cfg.num_processes)
        self._seen: dict[int, Any] = {k: None for k in followers}
        self._since = {k: clock() for k in followers}
        target = self._watch if cfg.is_leader else self._beat
        self._thread = threading.Thread(target=target, name="tokenspeed-liveness", daemon=True)
        if start:
            self._thread.start()

    # ------------------------------------------------------------------ follower
    def beat_once(self) -> bool:
        """Write the next heartbeat; False once the coordinator (the leader) is gone."""
        try:
            self._client.key_value_set(
                _HEARTBEAT_KEY.format(self.cfg.process_id), str(self._beats), allow_overwrite=True
            )
        except Exception as e:  # the leader (which hosts the service) is gone
            logger.error("heartbeat to the coordinator failed: %s", e)
            return False
        self._beats += 1
        return True

    def _beat(self) -> None:
        while not self._stop.is_set() and self.beat_once():
            self._stop.wait(self.cfg.heartbeat_interval_s)

    # ------------------------------------------------------------------ leader
    def check_followers(self, now: float) -> bool:
        """One watchdog tick at time `now`: True while every follower's counter moved within
        `follower_timeout_s`; otherwise records `lost`, calls `on_lost` and returns False."""
        for k in self._seen:
            try:
                value = self._client.key_value_try_get(_HEARTBEAT_KEY.format(k))
            except Exception:  # not written yet
                value = None
            if value is not None and value != self._seen[k]:
                self._seen[k], self._since[k] = value, now
            elif now - self._since[k] > self.cfg.follower_timeout_s:
                self.lost = (
                    f"tokenspeed-jax distributed: follower process {k} of "
                    f"{self.cfg.num_processes} stopped responding (no heartbeat for "
                    f"{now - self._since[k]:.1f}s > follower_timeout_s={self.cfg.follower_timeout_s}); "
                    f"it probably died. Every step runs collectives across all processes, so "
                    f"the leader cannot continue: restart all processes."
                )
                self._on_lost(self.lost)
                return False
        return True

    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_interval_s):
            if not self.check_followers(self._clock()):
                return

    def _default_on_lost(self, message: str) -> None:
        # Exit, whatever the main thread is doing: a step would block in a collective that never
        # finishes, and even a clean interpreter exit would block in jax's shutdown barrier.
        print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_FOLLOWER_LOST)

    def wait_for_verdict(self) -> str | None:
        """After a collective failed: give the watchdog time to declare a follower lost (the
        default handler then exits the process). Returns the message, or None if all are alive."""
        deadline = time.monotonic() + self.cfg.follower_timeout_s + 4 * self.cfg.heartbeat_interval_s
        while self.lost is None and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(self.cfg.heartbeat_interval_s / 4)
        return self.lost

    def check(self) -> None:
        if self.lost is not None:
            raise RuntimeError(self.lost)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.cfg.heartbeat_interval_s + 1)
