"""scan_layers (models/layer_scan.py): runs of identical layers, stacked pools, same tokens.

A model with runs of every layer kind (3 full attention, 2 conv, 2 sliding, 1 full) is served
through the real Scheduler and Engine with and without scan_layers: the same greedy tokens, the
same logprobs, the same page ids; the scanned program holds one layer body per run.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from scheduler import SchedulerConfig, cache_layout
from tests.native_kernels import need_native
from tokenspeed_jax.engine.engine import Engine
from tokenspeed_jax.models import build_model, tiny_random_config
from tokenspeed_jax.models.layer_scan import LayerRun, ScannedGraph, layer_runs
from tokenspeed_jax.runtime.prepare import prepare
from tokenspeed_jax.runtime.runner import ModelRunner
from tokenspeed_jax.sampling_params import SamplingParams

LAYERS = ("full_attention",) * 3 + ("conv",) * 2 + ("sliding_attention",) * 2 + ("full_attention",)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_random_config(layer_types=LAYERS, sliding_window=6)
    return cfg, build_model(cfg, seed=5)


def make_runner(setup, scan: bool) -> ModelRunner:
    cfg, model = setup
    sched = SchedulerConfig(
        num_pages=80, page_size=4, max_batch_requests=3, max_scheduled_tokens=16, max_context_len=48
    )
    layout = cache_layout(sched, cfg, conv_page_size=2)
    return ModelRunner(
        prepare(cfg, model), layout, backend="reference", min_token_bucket=16, scan_layers=scan
    )


def test_layer_runs_split_on_structure_and_group(setup):
    cfg, model = setup
    groups = make_runner(setup, False).layout.layer_groups
    runs = layer_runs(model, groups)
    assert [(r.start, r.stop) for r in runs] == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert all(r.group == groups[r.start] for r in runs)
    # one group for every layer: still split where the structure changes
    assert layer_runs(model, (0,) * 8)[0] == LayerRun(0, 3, 0)


def test_split_stacks_params_and_leaves_the_model_whole(setup):
    cfg, model = setup
    graph, params = ScannedGraph.split(model, (0,) * 8)
    assert len(model.layers) == 8  # restored after the shell was split off
    # o_proj: never fused (a runner built on the shared model may have tiled it and fused q/k/v)
    o = params["runs"][0]["self_attn"]["o_proj"]["kernel"][...]
    assert o.shape == (3, *model.layers[0].self_attn.o_proj.kernel[...].shape)
    np.testing.assert_array_equal(o[2], model.layers[2].self_attn.o_proj.kernel[...])
    assert "layers" not in params["shell"]


def run_engine(runner: ModelRunner, prompts, max_tokens=7):
    eng = Engine(runner.layout.scheduler_config, runner, vocab_size=256, async_scheduling=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, prompt_logprobs=True)
    for p in prompts:
        eng.add_request(p, params)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return [outs[k] for k in sorted(outs)]


def test_scan_serves_the_same_tokens_logprobs_and_pages(setup, max_logprob_diff):
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 256, 9).tolist()  # a shared prefix: prefix cache hits too
    prompts = [shared + rng.integers(1, 256, n).tolist() for n in (3, 14, 6, 21)]
    got = {}
    for scan in (False, True):
        runner = make_runner(setup, scan)
        got[scan] = (run_engine(runner, prompts), runner)
    plain, scanned = got[False][0], got[True][0]
    assert [o.token_ids for o in scanned] == [o.token_ids for o in plain]
    assert max_logprob_diff([o.logprobs for o in scanned], [o.logprobs for o in plain]) < 1e-5
    assert max_logprob_diff([o.prompt_logprobs for o in scanned], [o.prompt_logprobs for o in plain]) < 1e-5
    mirrors = [r.host_mirrors() for _, r in got.values()]
    for a, b in zip(*mirrors, strict=True):
        np.testing.assert_array_equal(a, b)  # the same page ids, group by group
    # the scanned pools are the plain ones stacked per run, page for page
    runs = got[True][1]._scan.runs
    plain_caches, run_caches = got[False][1].state.caches, got[True][1].state.caches
    for run, cache in zip(runs, run_caches, strict=True):
        for k, stacked in cache.items():
            for j, layer in enumerate(range(run.start, run.stop)):
                np.testing.assert_allclose(stacked[j], plain_caches[layer][k], atol=1e-6)


def test_scanned_program_traces_one_layer_per_run(setup):
    counts = {}
    for scan in (False, True):
        runner = make_runner(setup, scan)
        shape = runner.shapes.step_shape(runner_padding(runner))
        # the reference attention is one jitted function shared by every layer (one private
        # func in the module); count the products of the layers themselves (XLA dots, or the
        # native matmul's custom calls on a CPU with tile-major weights)
        funcs = runner._lower(shape).as_text().split("func.func")
        counts[scan] = sum(
            f.count("dot_general") + f.count("tokenspeed_block_matmul")
            for f in funcs
            if not f.lstrip().startswith("private @paged_attention_reference")
        )
    # plain: q, k, v, o and the MLP's 3 per attention layer, in_proj / out_proj + MLP per conv
    # layer, all unrolled; scanned: one body per run (4 runs, 8 layers)
    assert counts[True] < counts[False]
    assert counts[True] <= counts[False] * 4 // 8 + 4


def runner_padding(runner: ModelRunner):
    from scheduler import Scheduler

    return Scheduler(runner.layout.scheduler_config).padding_ops()


def test_program_key_tells_scan_apart(setup):
    keys = set()
    for scan in (False, True):
        runner = make_runner(setup, scan)
        keys.add(runner._program_key(runner.shapes.step_shape(runner_padding(runner))))
    assert len(keys) == 2


def test_scan_updates_the_pools_in_place(setup):
    runner = make_runner(setup, True)
    before = [a.unsafe_buffer_pointer() for c in runner.state.caches for a in c.values()]
    run_engine(runner, [[5, 6, 7, 8, 9]], max_tokens=2)
    after = [a.unsafe_buffer_pointer() for c in runner.state.caches for a in c.values()]
    # donated and updated in place by the scan: the pools never moved
    assert before == after
    assert jax.tree.leaves(runner.state.caches)[0].ndim == 5


def test_scanned_linears_read_their_stacked_weights_in_place(setup):
    """On XLA:CPU a scanned layer's weights would be `dynamic-slice`d out of the stacks, and XLA
    copies a slice before a custom call: a decode step read every weight three times. The
    native matmul gets the whole stack and the layer index instead (`LayerSlice`): no slice in
    the compiled program is as large as the smallest weight matrix."""
    need_native("block_matmul")
    runner = make_runner(setup, True)
    shape = runner.shapes.step_shape(runner_padding(runner))
    hlo = runner._lower(shape).compile().as_text()
    assert hlo.count("codes_stacked = true") >= 4  # one body per run, each with its Linears
    smallest = min(
        np.prod(leaf.shape[1:])
        for path, leaf in jax.tree_util.tree_flatten_with_path(runner.params["runs"])[0]
        if "kernel" in jax.tree_util.keystr(path)
    )
    sliced = [
        int(np.prod([int(d) for d in m.group(1).split(",") if d]))
        for m in re.finditer(r"= \w+\[([\d,]*)\]\S* (?:fusion|dynamic-slice)\([^\n]*dynamic.slice", hlo)
    ]
    assert sliced and max(sliced) < smallest
