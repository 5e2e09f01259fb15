"""Can two collective programs run at once on disjoint devices of the same processes (gloo)?
The fact behind multi-process data-parallel overlap (docs/distributed.md, "Data-parallel overlap").

    python benchmarks/distributed_overlap.py [--rounds 40]

Two processes x 2 CPU devices. "Replica" r = local device r of each process; its program is a
chain of 30 all-reduces over those two devices. Modes, each in a fresh pair of processes:
  serial        replica 0's program, wait, replica 1's, wait (what the runner did before)
  overlap       both dispatched, then waited for (what the runner does now)
  overlap_bcast as overlap, with an all-reduce over ALL devices (the old ops broadcast) between
                the two dispatches: expected to FAIL with gloo's "collective mismatch"
Prints per mode: rounds whose results differ from a solo run, wall seconds, or the failure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def _worker(pid: int, port: int, mode: str, rounds: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    local = [sorted((d for d in jax.devices() if d.process_index == k), key=lambda d: d.id) for k in range(2)]
    n = 1 << 18
    fns, xs = [], []
    for r in range(2):
        sh = NamedSharding(Mesh(np.array([local[0][r], local[1][r]]), ("tp",)), P("tp"))
        xs.append(
            jax.make_array_from_callback(
                (2 * n,), sh, lambda idx, r=r: np.full(n, float(r + 1 + pid), np.float32)
            )
        )

        def chain(x):
            for _ in range(30):
                x = x + jnp.sum(x.reshape(2, n), axis=0).repeat(2) * 1e-3
            return x

        fns.append(jax.jit(chain, out_shardings=sh))
    everyone = Mesh(np.array([d for k in range(2) for d in local[k]]).reshape(2, 2), ("proc", "local"))
    bcast = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(everyone, P()))
    rows = NamedSharding(everyone, P("proc"))
    ones = np.ones((1, 64), np.int32)
    ref = [np.asarray(jax.block_until_ready(fns[r](xs[r])).addressable_data(0)) for r in range(2)]
    t0, bad = time.perf_counter(), 0
    for _ in range(rounds):
        if mode == "serial":
            outs = [jax.block_until_ready(fns[r](xs[r])) for r in range(2)]
        else:
            outs = [fns[0](xs[0])]
            if mode == "overlap_bcast":
                bcast(jax.make_array_from_callback((2, 64), rows, lambda idx: ones))
            outs.append(fns[1](xs[1]))
            jax.block_until_ready(outs)
        bad += sum(not np.array_equal(np.asarray(o.addressable_data(0)), ref[r]) for r, o in enumerate(outs))
    print(f"RESULT {bad} {time.perf_counter() - t0:.2f}", flush=True)


def _run(mode: str, rounds: int) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(i), str(port), mode, str(rounds)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (1, 0)
    ]
    try:
        out = procs[1].communicate(timeout=600)[0]
        out = out + "\n" + procs[0].communicate(timeout=60)[0]  # the follower's side too
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    line = next((x for x in out.splitlines() if x.startswith("RESULT")), None)
    if out.count("RESULT") < 2:
        line = None
    if line is None:
        lines = out.splitlines()
        err = next((x for x in lines if "mismatch" in x), next((x for x in lines if "rror" in x), out[-200:]))
        return f"FAILED: {err.strip()[-200:]}"
    _, bad, wall = line.split()
    return f"{bad} mismatched results, {wall} s"


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    print(f"2 processes x 2 CPU devices (gloo), {a.rounds} rounds x 2 replicas x 30 all-reduces")
    for mode in ("serial", "overlap", "overlap_bcast"):
        print(f"{mode:<15}{_run(mode, a.rounds)}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        pid, port, mode, rounds = sys.argv[sys.argv.index("--worker") + 1 :][:4]
        _worker(int(pid), int(port), mode, int(rounds))
    else:
        main()
