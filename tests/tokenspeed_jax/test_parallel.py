"""Tensor- and data-parallel serving on 4 virtual CPU devices.

The device count is fixed when jax initializes, and pytest's process already has jax up with one
device, so the work runs in a subprocess (this file with `--worker`, under
`XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu`) that prints one JSON
record; the assertions run here on it:

- greedy tokens, logprobs and prompt logprobs of tp=2, dp=2 and tp=2 x dp=2 == tp=1 (1e-4),
  with the reference backend, and tp=2 with the Pallas kernels (interpret mode) under shard_map;
- params and pools really are sharded (specs and per-device shard shapes);
- dp: both replicas served requests, `stats()` sums them, `engine` is `engines[0]`;
- scan_layers under tp=2: same tokens, stacked params and pools sharded like their layer's;
- one compile per token bucket per replica (the sharded state keeps its sharding across steps);
- an MoE + sinks + biases config: sharded forward == unsharded (ragged_dot over sharded experts);
- bad sizes raise ValueError (tp=3 with 2 kv heads, tp*dp > devices, tp=0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it in the inner loop; CI runs it

SMALL = dict(page_size=4, num_pages=160, max_batch_requests=6, max_scheduled_tokens=32,
             max_context_len=96)


def _shapes_ready(programs) -> int:
    """Distinct step shapes made ready (compiled, or read back from the executable cache), once
    the lazily compiled ones have landed."""
    programs.wait_background()
    return len(programs.ready)


def _worker() -> dict:
    """Runs in the 4-device subprocess; returns plain numbers / lists for the parent to check."""
    import jax
    import numpy as np

    from tokenspeed_jax import LLM, SamplingParams

    assert len(jax.devices()) == 4, jax.devices()
    rng = np.random.default_rng(0)
    system = rng.integers(0, 256, 20).tolist()
    prompts = [system + rng.integers(0, 256, int(rng.integers(3, 20))).tolist() for _ in range(6)]
    gen = SamplingParams(max_tokens=16, logprobs=True, ignore_eos=True)
    plp = SamplingParams(max_tokens=4, logprobs=True, prompt_logprobs=True, ignore_eos=True)
    out: dict = {"runs": {}}

    def run(name, tp, dp, backend="reference", prompts=prompts, **kw):
        t0 = time.perf_counter()
        llm = LLM("tiny-random", tensor_parallel_size=tp, data_parallel_size=dp,
                  attention_backend=backend, **SMALL, **kw)
        outs = llm.generate(prompts, gen) + llm.generate(prompts[:2], plp)
        out["runs"][name] = {
            "tokens": [o.token_ids for o in outs],
            "logprobs": [o.logprobs for o in outs],
            "prompt_logprobs": [o.prompt_logprobs for o in outs],
            "seconds": time.perf_counter() - t0,
            "compiles": [_shapes_ready(e.runner.programs) for e in llm.engines],
        }
        return llm

    run("tp1", 1, 1)
    llm = run("tp2", 2, 1)
    runner = llm.engine.runner
    shards = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(runner.params):
        shards[jax.tree_util.keystr(path)] = [
            leaf.shape, [list(s.data.shape) for s in leaf.addressable_shards],
            len(leaf.sharding.device_set)]
    for i, cache in enumerate(runner.state.caches):
        for k, v in cache.items():
            shards[f"cache{i}.{k}"] = [v.shape, [list(s.data.shape) for s in v.addressable_shards],
                                       len(v.sharding.device_set)]
    out["shards"] = shards
    out["mirror_replicated"] = all(m.sharding.is_fully_replicated for m in runner.state.mirrors)

    llm = run("tp2dp2", 2, 2)
    st = llm.stats()
    out["dp"] = {
        "num_engines": len(llm.engines), "engine_is_first": llm.engine is llm.engines[0],
        "devices": [sorted(d.id for d in e.runner.params["norm"]["weight"][...].sharding.device_set)
                    for e in llm.engines],
        "replica_steps": [s["num_engine_steps"] for s in st["replicas"]],
        "total_pages": st["total_pages"], "free_pages": st["free_pages"],
        "replica_total_pages": [s["total_pages"] for s in st["replicas"]],
        "prefix_hit_rate": st["prefix_hit_rate"],
        "prefix_hit_tokens": st["prefix_hit_tokens"], "prefix_query_tokens": st["prefix_query_tokens"],
    }
    run("dp2", 1, 2)
    # scan_layers under tp: stacked params and pools keep their layer's spec behind the run axis
    runner = run("tp2_scan", 2, 1, scan_layers=True).engine.runner
    leaves = jax.tree_util.tree_leaves_with_path((runner.params, runner.state.caches))
    out["scan_shards"] = {jax.tree_util.keystr(p): [x.shape, list(x.addressable_shards[0].data.shape)]
                          for p, x in leaves}
    # a quantized KV cache (int8 + f16 scales): the scale pools shard on kv heads with their pool
    run("tp1_int8", 1, 1, kv_cache_dtype="int8")
    runner = run("tp2_int8", 2, 1, kv_cache_dtype="int8").engine.runner
    out["int8_shards"] = {f"cache0.{k}": [v.shape, [list(s.data.shape) for s in v.addressable_shards],
                                          str(v.dtype)] for k, v in runner.state.caches[0].items()}
    # int8 weights with int8 activations: column-parallel scales split with their columns, the
    # row-parallel layers' per-token activation absmax reduced across shards
    run("tp1_w8a8", 1, 1, quantization="w8a8", prompts=prompts[:3])
    run("tp2_w8a8", 2, 1, quantization="w8a8", prompts=prompts[:3])
    # Q8_0 blocks: scales f32[in/32, out] split like their kernel (columns, or input blocks)
    run("tp1_q8_0", 1, 1, quantization="q8_0", prompts=prompts[:3])
    runner = run("tp2_q8_0", 2, 1, quantization="q8_0", prompts=prompts[:3]).engine.runner
    out["q8_0_shards"] = {jax.tree_util.keystr(p): [x.shape, list(x.addressable_shards[0].data.shape)]
                          for p, x in jax.tree_util.tree_leaves_with_path(runner.params)
                          if "kernel_scale" in jax.tree_util.keystr(p)}
    run("tp2_pallas", 2, 1, backend="pallas", prompts=prompts[:3])
    run("tp1_pallas", 1, 1, backend="pallas", prompts=prompts[:3])
    out["moe_maxdiff"] = _moe_forward_diff()

    errors = {}
    for name, kw in {"tp3": dict(tensor_parallel_size=3), "tp4dp2": dict(tensor_parallel_size=4,
                     data_parallel_size=2), "tp0": dict(tensor_parallel_size=0)}.items():
        try:
            LLM("tiny-random", **kw, **SMALL)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def _moe_forward_diff() -> float:
    """max |logits(tp=2) - logits(tp=1)| of the dense forward of an MoE config with sinks and
    biases (the paged path shares every parameter rule; tiny-random itself has no MoE)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tokenspeed_jax.models import build_model, tiny_random_config
    from tokenspeed_jax.runtime.sharding import TensorParallel, prepare_model, replica_meshes

    cfg = tiny_random_config(num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0,
                             attention_sinks=True, attention_bias=True, conv_bias=True)
    net = build_model(cfg, 0)
    x = jnp.asarray(np.random.default_rng(1).integers(0, 256, 24))
    ref = np.asarray(net.dense(x))
    plan = TensorParallel(replica_meshes(2, 1)[0], cfg)
    prepare_model(net, 2)
    graph, params = nnx.split(net)
    sh = plan.param_shardings(params)
    f = jax.jit(lambda p, t: nnx.merge(graph, p).dense(t), in_shardings=(sh, plan.replicated))
    return float(np.abs(np.asarray(f(jax.device_put(params, sh), x)) - ref).max())


@pytest.fixture(scope="module")
def result() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall"] = time.perf_counter() - t0
    return out


@pytest.mark.parametrize("name,base", [("tp2", "tp1"), ("tp2dp2", "tp1"), ("dp2", "tp1"),
                                       ("tp2_pallas", "tp1_pallas"), ("tp2_scan", "tp1"),
                                       ("tp2_int8", "tp1_int8"), ("tp2_w8a8", "tp1_w8a8"),
                                       ("tp2_q8_0", "tp1_q8_0")])
def test_parallel_matches_single_device(result, name, base, max_logprob_diff):
    a, b = result["runs"][base], result["runs"][name]
    assert b["tokens"] == a["tokens"]
    assert max_logprob_diff(b["logprobs"], a["logprobs"]) < 1e-4
    assert max_logprob_diff(b["prompt_logprobs"], a["prompt_logprobs"]) < 1e-4


def test_q8_0_block_scales_split_with_their_kernels(result):
    shards = result["q8_0_shards"]
    q = next(v for k, v in shards.items() if "q_proj" in k)
    o = next(v for k, v in shards.items() if "o_proj" in k)
    assert q[1] == [q[0][0], q[0][1] // 2]  # column-parallel: split on out
    assert o[1] == [o[0][0] // 2, o[0][1]]  # row-parallel: split on input blocks


def test_one_compile_per_bucket_per_replica(result):
    """Sharded state comes back with the sharding it went in with: no recompiles."""
    runs = result["runs"]
    single = runs["tp1"]["compiles"]
    assert runs["tp2"]["compiles"] == single
    assert runs["tp2dp2"]["compiles"] == runs["dp2"]["compiles"] == single * 2


def test_pallas_tp_matches_reference(result, max_logprob_diff):
    """shard_map'd Pallas kernels (interpret mode) == the single-device reference backend."""
    a, b = result["runs"]["tp1"], result["runs"]["tp2_pallas"]
    assert b["tokens"][:3] == a["tokens"][:3]
    assert max_logprob_diff(b["logprobs"][:3], a["logprobs"][:3]) < 1e-4


def test_params_and_pools_are_sharded(result):
    sh = result["shards"]

    def check(key_part, full, shard):
        keys = [k for k in sh if key_part in k]
        assert keys, key_part
        for k in keys:
            shape, shards, ndev = sh[k]
            assert list(shape) == full and ndev == 2 and shards == [shard, shard], (k, sh[k])

    check("['layers'][0]['self_attn']['q_proj']['kernel']", [64, 64], [64, 32])
    check("['layers'][0]['self_attn']['k_proj']['kernel']", [64, 32], [64, 16])
    check("['layers'][0]['self_attn']['o_proj']['kernel']", [64, 64], [32, 64])
    check("['layers'][0]['mlp']['down_proj']['kernel']", [128, 64], [64, 64])
    check("['layers'][1]['conv']['in_proj']['kernel']", [64, 192], [64, 96])
    check("['layers'][1]['conv']['conv_weight']", [3, 64], [3, 32])
    check("['embed_tokens']", [260, 64], [130, 64])
    check("cache0.k", [160, 4, 2, 16], [160, 4, 1, 16])  # kv-head axis
    check("cache1.conv", [160, 8, 64], [160, 8, 32])  # channel axis
    assert result["mirror_replicated"]
    q = result["int8_shards"]  # int8 values and f16 scales (uint16 bits on the reference backend)
    assert q["cache0.k"] == [[160, 4, 2, 16], [[160, 4, 1, 16]] * 2, "int8"]
    assert q["cache0.k_scale"] == q["cache0.v_scale"] == [[160, 4, 2], [[160, 4, 1]] * 2, "uint16"]


def test_scanned_params_and_pools_are_sharded(result):
    sh = {k: v for k, v in result["scan_shards"].items()}
    q = [v for k, v in sh.items() if "['runs'][0]['self_attn']['q_proj']['kernel']" in k]
    assert q == [[[1, 64, 64], [1, 64, 32]]]
    emb = [v for k, v in sh.items() if "['shell']['embed_tokens']" in k]
    assert emb == [[[260, 64], [130, 64]]]
    pools = [v for k, v in sh.items() if k.endswith("['k']")]
    assert pools and all(v == [[1, 160, 4, 2, 16], [1, 160, 4, 1, 16]] for v in pools)


def test_data_parallel_replicas(result):
    dp = result["dp"]
    assert dp["num_engines"] == 2 and dp["engine_is_first"]
    assert dp["devices"] == [[0, 1], [2, 3]]
    assert all(s > 0 for s in dp["replica_steps"]), "both replicas must serve requests"
    assert dp["total_pages"] == sum(dp["replica_total_pages"]) == 2 * 159
    assert dp["free_pages"] == dp["total_pages"]  # nothing leaked
    assert dp["prefix_hit_rate"] == pytest.approx(dp["prefix_hit_tokens"] / dp["prefix_query_tokens"])


def test_moe_sharded_forward(result):
    assert result["moe_maxdiff"] < 1e-4


def test_bad_sizes_raise(result):
    err = result["errors"]
    assert err["tp3"] is not None and "num_key_value_heads=2" in err["tp3"]
    assert err["tp4dp2"] is not None and "exceeds the 4 available" in err["tp4dp2"]
    assert err["tp0"] is not None


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print(json.dumps(_worker()))
