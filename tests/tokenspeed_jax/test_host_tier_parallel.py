"""The host KV tier under tensor and data parallelism (issue 49): on 4 virtual CPU devices (a
subprocess), tp=2 and dp=2 with the tier give tiny-random's tokens of one device without it,
with host hits: the copy programs keep the pools' shardings and run on each replica's device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it in the inner loop; CI runs it

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import json
from tests.tokenspeed_jax.test_host_tier import SP, _prompts
from tokenspeed_jax import LLM

def run(**kw):
    llm = LLM("tiny-random", page_size=8, num_pages=28, max_batch_requests=2, max_scheduled_tokens=16,
              max_context_len=64, compile_cache_dir=False, lazy_compile="sync", **kw)
    outs = [o for p in _prompts() for o in llm.generate([p], SP)]
    st = llm.stats()
    return {"tokens": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
            "host_hit_tokens": st.get("host_hit_tokens", 0), "leak": st["total_pages"] - st["free_pages"]}

out = {"tp1": run()}
out["tp2"] = run(tensor_parallel_size=2, kv_offloading_size=0.002)
out["dp2"] = run(data_parallel_size=2, kv_offloading_size=0.002)
print(json.dumps(out))
"""


def test_tp2_and_dp2_with_the_tier_equal_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    base = out["tp1"]
    for name in ("tp2", "dp2"):
        got = out[name]
        assert got["tokens"] == base["tokens"], name
        diff = max(abs(a - b) for x, y in zip(got["logprobs"], base["logprobs"]) for a, b in zip(x, y))
        assert diff < 1e-4, (name, diff)
        assert got["host_hit_tokens"] > 0 and got["leak"] == 0, name
