"""benchmarks/device_e2e.sh (issue 46) runs once, unattended, in a rare GPU window: its rehearsal
(E2E_REHEARSE=1: every step at tiny sizes on CPU, reference backend) must pass here first, each
step leaving its RESULT lines, and its step timeouts must fit the window."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device_e2e.sh"
STEPS = ("1_checkpoint", "2_cold_start", "2_checks", "2_decode", "3_warm_start", "3_warm_same_tokens",
         "4_bandwidth", "4_dense_decode", "5_transformers", "6_recurrent", "7_summary")  # fmt: skip


def test_timeouts_fit_the_window() -> None:
    steps = re.findall(r"^step (\S+) (\d+) ", SCRIPT.read_text(), flags=re.M)
    assert len(steps) == 7 and sum(int(t) for _, t in steps) <= 570, steps  # the call limit: 600 s


@pytest.mark.slow
@pytest.mark.hf
def test_the_rehearsal_runs_every_step(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    env = {**os.environ, "E2E_REHEARSE": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env['PATH']}"  # python3 = this venv's
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recs = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by = {}
    for r in recs:
        by.setdefault(r["step"], []).append(r)
    assert set(STEPS) <= set(by), sorted(by)
    cold = by["2_cold_start"][0]
    assert cold["args"]["dtype"] == "auto" and cold["param_dtype"] == "bfloat16"  # the checkpoint's
    assert cold["shapes_compiled"] > 0 and by["3_warm_start"][0]["shapes_loaded"] > 0
    assert by["3_warm_same_tokens"][0]["all_same"]
    checks = by["2_checks"][0]
    assert all(checks["sampled_same"]) and checks["prompt_logprobs_finite"]
    assert {(r["rows"], r["overlapped"]) for r in by["2_decode"]} == {
        (n, o) for n in (8, 4, 1) for o in (True, False)
    }
    kernel = {r["impl"]: r for r in by["6_recurrent"]}
    assert "failed" not in kernel["pallas"] and kernel["pallas"]["max_diff_out"] < 1e-3, kernel
    hf = by["5_transformers"][0]
    assert hf["greedy_agreement"] >= 0.9 and hf["mean_abs_dlogprob"] < 0.05, hf
