"""`tokenspeed-jax run` end to end on the built-in model (the README's main job, shrunk)."""

from __future__ import annotations

import json

import pytest

from tokenspeed_jax import cli

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it in the inner loop; CI runs it


def test_run_job_end_to_end_both_loops_same_figures(capsys):
    argv = [
        "run",
        "--sessions",
        "3",
        "--turns",
        "2",
        "--system-tokens",
        "40",
        "--user-tokens",
        "8",
        "--max-tokens",
        "5",
        "--page-size",
        "8",
        "--num-pages",
        "64",
        "--max-batch-requests",
        "4",
        "--max-scheduled-tokens",
        "64",
        "--max-context-len",
        "128",
        "--no-progress",
        "--json",
    ]
    summaries = {}
    for loop in ("sync", "async"):
        assert cli.main([*argv, "--async-scheduling" if loop == "async" else "--no-async-scheduling"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert f"loop={loop}" in out[0]
        summaries[loop] = s = json.loads(out[-1])
        assert s["requests"] == 6 and s["generated_tokens"] == 30
        assert s["prompt_tokens"] == 3 * 48 + 3 * (48 + 5 + 8)
        assert s["retractions"] == 0
        # every shape it used was made ready before serving: compiled, or read back from the
        # executable cache (the second loop reads what the first one stored)
        ready = next(line for line in out if line.startswith("start-up:"))
        assert " 0 step shapes ready" not in ready and "step shapes ready" in ready
    sync, overlapped = summaries["sync"], summaries["async"]
    # the overlapped loop hits the prefix cache and holds pages exactly as the synchronous one
    # (its steps may differ: a follow-up turn is sent when its reply returns, a call later)
    for key in ("computed_prompt_tokens", "prefix_hit_rate", "peak_pages"):
        assert overlapped[key] == sync[key], key
    assert sync["prefix_hit_rate"] > 0.5  # the system prompt and each session's history
