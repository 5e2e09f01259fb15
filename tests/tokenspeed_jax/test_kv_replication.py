"""KV-head replication (tensor_parallel_size > num_key_value_heads) on 8 virtual CPU devices.

Like test_parallel.py, the work runs in a subprocess (`--worker`, 8 devices) that prints one JSON
record. Checks: tp=4 on tiny-random (2 KV heads -> each replicated twice) and tp=8 on a variant
with 8 query / 4 KV heads give the single-device greedy tokens (logprobs within 1e-4); every pool
shard holds exactly one KV head; the Pallas kernels under shard_map agree; the widened k/v
projections hold each original head `tp / Hkv` times; sizes that are neither a divisor nor a
multiple of the KV heads (or do not divide the query heads) still raise ValueError.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it in the inner loop; CI runs it

# min_token_bucket=16: one step shape per LLM (no 1-token bucket to compile besides)
SMALL = dict(
    page_size=4,
    num_pages=96,
    max_batch_requests=4,
    max_scheduled_tokens=16,
    min_token_bucket=16,
    max_context_len=64,
)
WIDE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8)  # tp=8 needs 8 q heads


def _worker() -> dict:
    import jax
    import numpy as np

    from tokenspeed_jax import LLM, SamplingParams
    from tokenspeed_jax.models import registry

    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(rng.integers(3, 14))).tolist() for _ in range(4)]
    sp = SamplingParams(max_tokens=10, logprobs=True, ignore_eos=True)
    builtin = registry.load_builtin
    out: dict = {"runs": {}}

    def run(name, tp, overrides=None, backend="reference"):
        # the built-in loader with config overrides (LLM only takes a model name)
        registry.load_builtin = lambda n, seed=0, **kw: builtin(n, seed, **kw, **(overrides or {}))
        try:
            llm = LLM("tiny-random", tensor_parallel_size=tp, attention_backend=backend, **SMALL)
        finally:
            registry.load_builtin = builtin
        outs = llm.generate(prompts, sp)
        runner = llm.engine.runner
        k = runner.state.caches[0]["k"]
        out["runs"][name] = {
            "tokens": [o.token_ids for o in outs],
            "logprobs": [o.logprobs for o in outs],
            "pool": [list(k.shape), sorted({tuple(s.data.shape) for s in k.addressable_shards})],
        }
        return llm

    run("tiny_tp1", 1)
    run("tiny_tp4", 4)
    run("tiny_tp4_pallas", 4, backend="pallas")
    run("tiny_tp1_pallas", 1, backend="pallas")
    run("wide_tp1", 1, WIDE)
    run("wide_tp8", 8, WIDE)
    errors = {}
    for tp in (3, 6):
        try:
            LLM("tiny-random", tensor_parallel_size=tp, **SMALL)
            errors[tp] = None
        except ValueError as e:
            errors[tp] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def result() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name,base", [("tiny_tp4", "tiny_tp1"), ("wide_tp8", "wide_tp1"), ("tiny_tp4_pallas", "tiny_tp1_pallas")]
)
def test_replicated_kv_heads_match_one_device(result, name, base, max_logprob_diff):
    a, b = result["runs"][base], result["runs"][name]
    assert b["tokens"] == a["tokens"]
    assert max_logprob_diff(b["logprobs"], a["logprobs"]) <= 1e-4


@pytest.mark.parametrize("name,tp", [("tiny_tp4", 4), ("wide_tp8", 8)])
def test_one_kv_head_per_shard(result, name, tp):
    (p, b, h, d), shards = result["runs"][name]["pool"]
    assert h == tp and shards == [[p, b, 1, d]]


def test_projection_repeats_each_head():
    """Host-side check of the widening itself (no devices needed)."""
    import numpy as np

    from tokenspeed_jax.models import build_model, tiny_random_config
    from tokenspeed_jax.runtime.sharding import replicate_kv_heads

    cfg = tiny_random_config(attention_bias=True)
    net = build_model(cfg, 0)
    attn = net.layers[0].self_attn
    w = np.asarray(attn.k_proj.kernel[...]).reshape(64, 2, 16)
    b = np.random.default_rng(0).normal(size=32).astype(np.float32)
    attn.k_proj.bias.set_value(attn.k_proj.bias[...] + b)
    new = replicate_kv_heads(net, cfg, 4)
    assert new.num_key_value_heads == 4 and attn.num_kv_heads == 4
    w4 = np.asarray(attn.k_proj.kernel[...]).reshape(64, 4, 16)
    for s in range(4):  # shard s holds KV head s // 2
        np.testing.assert_array_equal(w4[:, s], w[:, s // 2])
    np.testing.assert_allclose(np.asarray(attn.k_proj.bias[...]).reshape(4, 16)[3], b.reshape(2, 16)[1])
    assert replicate_kv_heads(net, cfg, 4) == new and attn.num_kv_heads == 4  # idempotent
    assert replicate_kv_heads(net, cfg, 2) is cfg  # tp <= Hkv: nothing to do


def test_bad_sizes_still_raise(result):
    err = result["errors"]
    assert err["3"] is not None and "num_key_value_heads=2" in err["3"]  # neither divisor nor multiple
    assert err["6"] is not None and "num_attention_heads=4" in err["6"]  # a multiple, but 4 q heads


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print(json.dumps(_worker()))
