"""The peer-benchmark helpers (benchmarks/_peer.py, benchmarks/batch1.py): the child protocol,
interleaved reps, median / range, the output-length check and the batch-1 read bound. No engine
runs here: children are tiny Python scripts."""

from __future__ import annotations

import os
import sys
import time

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
_saved_path = list(sys.path)
sys.path.insert(0, _BENCH)

import _peer  # noqa: E402
import batch1  # noqa: E402

# benchmarks/ stays last on the path only (for the scripts' lazy imports): first, its kernels.py
# shadows the `kernels` package transformers imports in later test files of this worker
sys.path[:] = [*_saved_path, _BENCH]

_ECHO = (
    _peer.CHILD_IO
    + r"""
kw = json.loads(open(sys.argv[1]).read())
out = channel()
print("noise on stdout goes to the log")  # must not be read as protocol
send(out, "READY", {"hello": kw["name"]})
for cmd in commands():
    if cmd.get("die"):
        sys.exit(3)
    send(out, "RESULT", {"twice": 2 * cmd["x"]})
"""
)


def test_engine_child_protocol(tmp_path) -> None:
    with _peer.EngineChild(
        "echo", sys.executable, _ECHO, {"name": "e"}, dict(os.environ), str(tmp_path)
    ) as c:
        assert c.info == {"hello": "e"}
        assert c.ask({"x": 4}) == {"twice": 8}
        assert c.ask({"x": 5}) == {"twice": 10}
        assert _peer.process_tree(c.pid)[0] == c.pid
        with pytest.raises(RuntimeError, match="exited with 3"):
            c.ask({"die": True})
    with open(tmp_path / "child_echo.log") as f:
        assert "noise on stdout" in f.read()


def test_interleave_rotates_and_measures() -> None:
    order: list[tuple[str, int]] = []

    def run(name: str, r: int) -> dict:
        order.append((name, r))
        t = time.process_time()
        while time.process_time() - t < 0.05:  # some CPU time for busy_cores
            pass
        return {}

    res = _peer.interleave(["a", "b", "c"], 3, run, lambda name: os.getpid(), freeze=False)
    assert order == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2)]
    assert all(len(v) == 3 for v in res.values())
    assert all(r["busy_cores"] > 0 and r["wall_s"] > 0 for v in res.values() for r in v)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_interleave_freezes_the_waiting_engines(tmp_path) -> None:
    with (
        _peer.EngineChild("a", sys.executable, _ECHO, {"name": "a"}, dict(os.environ), str(tmp_path)) as a,
        _peer.EngineChild("b", sys.executable, _ECHO, {"name": "b"}, dict(os.environ), str(tmp_path)) as b,
    ):
        kids = {"a": a, "b": b}
        seen = []

        def run(name: str, r: int) -> dict:
            other = kids["b" if name == "a" else "a"]
            seen.append((_state(other.pid), kids[name].ask({"x": r})["twice"]))
            return {}

        _peer.interleave(["a", "b"], 2, run, lambda name: kids[name].pid)
        assert seen == [("T", 0), ("T", 0), ("T", 2), ("T", 2)]  # T: stopped
        assert _state(a.pid) != "T" and _state(b.pid) != "T"  # continued at the end


def test_stats_and_ratios() -> None:
    assert _peer.med_range([3.0, 1.0, 2.0]) == "2.0 (1.0-3.0)"
    tok = {"ours": [10.0, 12.0, 11.0], "vllm": [5.0, 6.0, 7.0], "vllm-both": [8.0, 9.0, 7.0]}
    assert _peer.better_vllm(tok) == "vllm-both"
    assert _peer.better_vllm({"ours": [1.0]}) is None
    assert _peer.paired_ratio([10.0, 12.0], [5.0, 10.0]) == "1.47x (1.20-2.00 per rep)"


def test_check_lengths_fails_loudly() -> None:
    _peer.check_lengths("x", [4, 4], 4)
    with pytest.raises(SystemExit, match="1 of 3 outputs"):
        _peer.check_lengths("x", [4, 3, 4], 4)
    with pytest.raises(SystemExit):
        _peer.check_lengths("x", [], 4)


def test_vllm_env_configs() -> None:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"  # an inherited binding must not leak in
    try:
        default, both = _peer.vllm_env(2, "vllm"), _peer.vllm_env(2, "vllm-both")
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in default
    assert both["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert default["VLLM_CPU_KVCACHE_SPACE"] == "2" and "PYTHONPATH" not in default


def test_bytes_per_pass_counts_weights_and_attended_kv() -> None:
    # 2 prompts of 10 ids, 4 tokens: decode steps attend to 11, 12, 13 tokens
    weights, kv = 1000, [8, 8]
    full = batch1.bytes_per_pass(weights, kv, [None, None], [10, 10], 4)
    assert full == 2 * (3 * weights + 2 * 8 * (11 + 12 + 13))
    windowed = batch1.bytes_per_pass(weights, kv, [None, 12], [10, 10], 4)
    assert windowed == 2 * (3 * weights + 8 * (11 + 12 + 13) + 8 * (11 + 12 + 12))


def test_over_bound_and_bandwidth() -> None:
    assert batch1.over_bound({"a": [0.5, 0.99]}) == []
    assert batch1.over_bound({"a": [0.5, 1.2]}) == ["a: 120% of the bound"]
    assert batch1.read_bandwidth(8 << 20, 2, rounds=2) > 1e8


def test_vllm_logged_binding(tmp_path) -> None:
    log = tmp_path / "v.log"
    log.write_text(
        "(EngineCore pid=1) INFO 12-05 11:36:21 [ompmultiprocessing.py:185] OpenMP thread "
        "binding info: \n"
        "(EngineCore pid=1) INFO 12-05 11:36:21 [ompmultiprocessing.py:185] \tlocal_world_size=1,"
        " reserve_cpu_num=1\n"
        "(EngineCore pid=1) INFO 12-05 11:36:21 [ompmultiprocessing.py:185] \tlocal_rank=0, "
        "core ids=[0]\n"
        "(EngineCore pid=1) INFO 12-05 11:36:21 [ompmultiprocessing.py:185] \treserved_cpus=[1]\n"
    )
    assert _peer.vllm_logged_binding(str(log)) == (
        "local_world_size=1, reserve_cpu_num=1; local_rank=0, core ids=[0]; reserved_cpus=[1]"
    )
