"""The worker of the tensor- / data-parallel tests (test_parallel.py, test_parallel_quant.py).

The device count is fixed when jax initializes, and pytest's process already has jax up with one
device, so the work runs in a subprocess (this file with `--worker GROUP`, under
`XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu`) that prints one JSON
record; the test files assert on it. Groups "core", "quant" and "weights" (test_parallel_weights.py:
update_weights / sleep under tp and dp), one subprocess each: each test file's fixture runs
one, so the test workers take them in parallel (one subprocess did both in ~530 s of a CI run,
its 600 s timeout near).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# one token bucket (16): each LLM compiles one step shape per kv bucket, not three (1, 16, 32);
# the compiles of ~9 LLMs per group are most of these fixtures' time on 2 shared cores
SMALL = dict(
    page_size=4,
    num_pages=160,
    max_batch_requests=6,
    max_scheduled_tokens=16,
    min_token_bucket=16,
    max_context_len=96,
)


def _shapes_ready(programs) -> int:
    """Distinct step shapes made ready (compiled, or read back from the executable cache), once
    the lazily compiled ones have landed."""
    programs.wait_background()
    return len(programs.ready)


def worker(group: str) -> dict:
    """Runs in the 4-device subprocess; returns plain numbers / lists for the parent to check.
    group "core": tp / dp / scan / MoE / bad sizes; "quant": quantized KV and weights, Pallas."""
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

    def run(name, tp, dp, backend="reference", prompts=prompts, model="tiny-random", **kw):
        t0 = time.perf_counter()
        llm = LLM(
            model,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            attention_backend=backend,
            **SMALL,
            **kw,
        )
        outs = llm.generate(prompts, gen) + llm.generate(prompts[:2], plp)
        out["runs"][name] = {
            "tokens": [o.token_ids for o in outs],
            "logprobs": [o.logprobs for o in outs],
            "prompt_logprobs": [o.prompt_logprobs for o in outs],
            "seconds": time.perf_counter() - t0,
            "compiles": [_shapes_ready(e.runner.programs) for e in llm.engines],
        }
        return llm

    if group == "weights":
        return _weights_group(run, prompts, gen, plp, out)
    if group == "quant":
        # the reference backend on the prompts the Pallas runs take
        run("tp1_ref3", 1, 1, prompts=prompts[:3])
        # a quantized KV cache (int8 + f16 scales): the scale pools shard on kv heads with their
        # pool
        run("tp1_int8", 1, 1, kv_cache_dtype="int8")
        runner = run("tp2_int8", 2, 1, kv_cache_dtype="int8").engine.runner
        out["int8_shards"] = {
            f"cache0.{k}": [v.shape, [list(s.data.shape) for s in v.addressable_shards], str(v.dtype)]
            for k, v in runner.state.caches[0].items()
        }
        # int8 weights with int8 activations: column-parallel scales split with their columns,
        # the row-parallel layers' per-token activation absmax reduced across shards
        run("tp1_w8a8", 1, 1, quantization="w8a8", prompts=prompts[:3])
        run("tp2_w8a8", 2, 1, quantization="w8a8", prompts=prompts[:3])
        # Q8_0 blocks: scales f32[in/32, out] split like their kernel (columns, or input blocks)
        run("tp1_q8_0", 1, 1, quantization="q8_0", prompts=prompts[:3])
        runner = run("tp2_q8_0", 2, 1, quantization="q8_0", prompts=prompts[:3]).engine.runner
        out["q8_0_shards"] = {
            jax.tree_util.keystr(p): [x.shape, list(x.addressable_shards[0].data.shape)]
            for p, x in jax.tree_util.tree_leaves_with_path(runner.params)
            if "kernel_scale" in jax.tree_util.keystr(p)
        }
        # q/k/v and gate/up fused as on a GPU (issue 46): columns interleaved per shard
        from tokenspeed_jax.runtime import prepare as prep

        default = prep.fuse_by_default
        prep.fuse_by_default = lambda platform: True
        try:
            runner = run("tp2_fused", 2, 1).engine.runner
            run("tp2_w8a8_fused", 2, 1, quantization="w8a8", prompts=prompts[:3])
        finally:
            prep.fuse_by_default = default
        out["fused_shards"] = {
            jax.tree_util.keystr(p): [x.shape, list(x.addressable_shards[0].data.shape)]
            for p, x in jax.tree_util.tree_leaves_with_path(runner.params)
            if "qkv_proj" in jax.tree_util.keystr(p) or "gate_up_proj" in jax.tree_util.keystr(p)
        }
        run("tp1", 1, 1)
        run("tp2_pallas", 2, 1, backend="pallas", prompts=prompts[:3])
        run("tp1_pallas", 1, 1, backend="pallas", prompts=prompts[:3])
        return out

    run("tp1", 1, 1)
    # a second tp=1 LLM loads its shapes from the executable store, onto one of the 4 devices
    out["tp1_warm_loaded"] = run("tp1_warm", 1, 1).stats()["startup"]["shapes_loaded"]
    llm = run("tp2", 2, 1)
    runner = llm.engine.runner
    shards = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(runner.params):
        shards[jax.tree_util.keystr(path)] = [
            leaf.shape,
            [list(s.data.shape) for s in leaf.addressable_shards],
            len(leaf.sharding.device_set),
        ]
    for i, cache in enumerate(runner.state.caches):
        for k, v in cache.items():
            shards[f"cache{i}.{k}"] = [
                v.shape,
                [list(s.data.shape) for s in v.addressable_shards],
                len(v.sharding.device_set),
            ]
    out["shards"] = shards
    out["mirror_replicated"] = all(m.sharding.is_fully_replicated for m in runner.state.mirrors)

    llm = run("tp2dp2", 2, 2)
    st = llm.stats()
    out["dp"] = {
        "num_engines": len(llm.engines),
        "engine_is_first": llm.engine is llm.engines[0],
        "devices": [
            sorted(d.id for d in e.runner.params["norm"]["weight"][...].sharding.device_set)
            for e in llm.engines
        ],
        "replica_steps": [s["num_engine_steps"] for s in st["replicas"]],
        "total_pages": st["total_pages"],
        "free_pages": st["free_pages"],
        "replica_total_pages": [s["total_pages"] for s in st["replicas"]],
        "prefix_hit_rate": st["prefix_hit_rate"],
        "prefix_hit_tokens": st["prefix_hit_tokens"],
        "prefix_query_tokens": st["prefix_query_tokens"],
    }
    run("dp2", 1, 2)
    # scan_layers under tp: stacked params and pools keep their layer's spec behind the run axis
    # a recurrent hybrid: attention and Gated DeltaNet heads sharded, state pools on heads
    run("hybrid_tp1", 1, 1, model="tiny-hybrid")
    runner = run("hybrid_tp2", 2, 1, model="tiny-hybrid").engine.runner
    out["hybrid_shards"] = _shard_shapes(runner, "linear_attn", "ssm", "conv_state")
    runner = run("tp2_scan", 2, 1, scan_layers=True).engine.runner
    leaves = jax.tree_util.tree_leaves_with_path((runner.params, runner.state.caches))
    out["scan_shards"] = {
        jax.tree_util.keystr(p): [x.shape, list(x.addressable_shards[0].data.shape)] for p, x in leaves
    }
    out["moe_maxdiff"] = _moe_forward_diff()
    out["recurrent_maxdiff"] = {
        f"tp{tp}_g{g}": _recurrent_forward_diff(tp, g) for tp, g in ((2, 2), (4, 2), (2, 1))
    }
    errors = {}
    for name, kw in {
        "tp3": dict(tensor_parallel_size=3),
        "tp4dp2": dict(tensor_parallel_size=4, data_parallel_size=2),
        "tp0": dict(tensor_parallel_size=0),
    }.items():
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
    from tokenspeed_jax.runtime.sharding import TensorParallel, relayout_conv, replica_meshes

    cfg = tiny_random_config(
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=7.0,
        attention_sinks=True,
        attention_bias=True,
        conv_bias=True,
    )
    net = build_model(cfg, 0)
    x = jnp.asarray(np.random.default_rng(1).integers(0, 256, 24))
    ref = np.asarray(net.dense(x))
    plan = TensorParallel(replica_meshes(2, 1)[0], cfg)
    relayout_conv(net, 2)
    graph, params = nnx.split(net)
    sh = plan.param_shardings(params)
    f = jax.jit(lambda p, t: nnx.merge(graph, p).dense(t), in_shardings=(sh, plan.replicated))
    return float(np.abs(np.asarray(f(jax.device_put(params, sh), x)) - ref).max())


def _shard_shapes(runner, *parts: str) -> dict:
    """{path: [shape, first shard's shape]} of the runner's params and pools whose path names
    one of `parts`."""
    import jax

    leaves = jax.tree_util.tree_leaves_with_path((runner.params, runner.state.caches))
    return {
        jax.tree_util.keystr(p): [list(x.shape), list(x.addressable_shards[0].data.shape)]
        for p, x in leaves
        if any(part in jax.tree_util.keystr(p) for part in parts)
    }


def _recurrent_forward_diff(tp: int, groups: int) -> list:
    """[max |logits(tp) - logits(tp=1)|, all-gathers in the compiled forward] of the dense
    forward of a Mamba2 + Gated DeltaNet + attention config with `groups` B / C groups (tp >
    groups: replicated onto the shards), biases on; the paged path is tiny-hybrid's run above
    (same rules)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tokenspeed_jax.models import build_model
    from tokenspeed_jax.models.registry import tiny_hybrid_config
    from tokenspeed_jax.runtime.sharding import TensorParallel, relayout_recurrent, replica_meshes

    cfg = dataclasses.replace(
        tiny_hybrid_config(), layer_types=("mamba", "linear_attention", "full_attention"),
        linear_num_key_heads=4, linear_num_value_heads=8, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=groups, mamba_d_state=8, mamba_proj_bias=True, num_key_value_heads=4,
    )  # fmt: skip
    net = build_model(cfg, 0)
    for layer in net.layers:  # non-zero biases, so their columns are checked
        m = getattr(layer, "mamba", None)
        if m is not None:
            for p in (m.in_proj.bias, m.conv_bias, m.out_proj.bias):
                p.set_value(
                    0.1 * jax.random.normal(jax.random.key(7), p.get_value().shape, p.get_value().dtype)
                )
    x = jnp.asarray(np.random.default_rng(1).integers(0, 256, 24))
    ref = np.asarray(net.dense(x))
    relayout_recurrent(net, cfg, tp)
    plan = TensorParallel(replica_meshes(tp, 1)[0], cfg)
    graph, params = nnx.split(net)
    sh = plan.param_shardings(params)
    placed = jax.device_put(params, sh)
    # the recurrent layers really are split: a head-sharded parameter holds 1/tp on a device
    assert placed["layers"][1]["linear_attn"]["dt_bias"][...].addressable_shards[0].data.shape == (8 // tp,)
    assert placed["layers"][0]["mamba"]["D"][...].addressable_shards[0].data.shape == (4 // tp,)
    f = jax.jit(lambda p, t: nnx.merge(graph, p).dense(t), in_shardings=(sh, plan.replicated))
    # heads stay local: the collectives are all-reduces (row-parallel outputs, the Mamba2 norm
    # of a group spread over shards), never an all-gather of activations or weights
    gathers = f.lower(placed, x).compile().as_text().count(" all-gather(")
    return [float(np.abs(np.asarray(f(placed, x)) - ref).max()), gathers]


def _weights_group(run, prompts, gen, plp, out: dict) -> dict:
    """update_weights / sleep / wake_up under tp=2 (issue 48): plain, and with int8 weights and
    q/k/v + gate/up fused for the shards (the accelerator layout): the updated LLM == a fresh
    LLM of the new weights; every leaf keeps its sharding; no step recompiles."""
    import jax
    from flax import nnx

    from tokenspeed_jax.models import registry
    from tokenspeed_jax.runtime import prepare as prep

    new = nnx.state(registry.load_builtin("tiny-random", seed=1)[1], nnx.Param)

    def record(name, llm):
        outs = llm.generate(prompts, gen) + llm.generate(prompts[:2], plp)
        out["runs"][name] = {
            "tokens": [o.token_ids for o in outs],
            "logprobs": [o.logprobs for o in outs],
            "prompt_logprobs": [o.prompt_logprobs for o in outs],
            "versions": sorted({o.weight_version for o in outs}),
        }

    default = prep.fuse_by_default
    out["checks"] = {}
    for tag, kw in {"tp2": {}, "tp2_int8_fused": {"quantization": "int8"}}.items():
        prep.fuse_by_default = (lambda platform: True) if "fused" in tag else default
        try:
            run(f"{tag}_seed1", 2, 1, seed=1, **kw)
            llm = run(tag, 2, 1, seed=0, lazy_compile="sync", **kw)  # counts compiles: none in the background
        finally:
            prep.fuse_by_default = default
        runner = llm.engine.runner
        before = [x.sharding for x in runner.param_leaves]
        compiles = llm.stats()["num_compiles"]
        info = llm.update_weights(new)
        record(f"{tag}_updated", llm)
        slept = llm.sleep()
        llm.wake_up()
        record(f"{tag}_woken", llm)
        st = llm.stats()
        out["checks"][tag] = {
            "replaced": info["replaced"],
            "leaves": len(runner.param_leaves),
            "same_shardings": all(a == x.sharding for a, x in zip(before, runner.param_leaves)),
            "sharded": sum(len(x.sharding.device_set) == 2 for x in runner.param_leaves),
            "fused": any(
                "qkv_proj" in jax.tree_util.keystr(p)
                for p, _ in jax.tree_util.tree_leaves_with_path(runner.params)
            ),
            "compiles_same": st["num_compiles"] == compiles,
            "pages_free": st["free_pages"] == st["total_pages"],
            "kv_freed": slept["freed_bytes"] >= 0.9 * slept["kv_bytes"] > 0,
        }
    # data parallel: each replica's leaves go to its own devices
    run("tp1_seed1", 1, 1, seed=1)
    llm = run("dp2", 1, 2, seed=0)
    llm.update_weights(new)
    record("dp2_updated", llm)
    out["dp2_devices"] = [
        sorted({d.id for x in e.runner.param_leaves for d in x.sharding.device_set}) for e in llm.engines
    ]
    return out


def check_same_outputs(result: dict, name: str, base: str, max_logprob_diff) -> None:
    """Run `name` gave run `base`'s greedy tokens, and its logprobs and prompt logprobs within
    1e-4 (the parametrized body of both test files)."""
    a, b = result["runs"][base], result["runs"][name]
    assert b["tokens"] == a["tokens"]
    assert max_logprob_diff(b["logprobs"], a["logprobs"]) < 1e-4
    assert max_logprob_diff(b["prompt_logprobs"], a["prompt_logprobs"]) < 1e-4


def run_worker(group: str) -> dict:
    """This file as a script on 4 virtual CPU devices; its JSON record."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", group], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall"] = time.perf_counter() - t0
    return out


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print(json.dumps(worker(sys.argv[sys.argv.index("--worker") + 1])))
