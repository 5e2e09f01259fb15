"""LLM.update_weights / weight_version / sleep / wake_up on the built-in tiny model (issue 48):
an update gives what a fresh LLM of the new weights gives (greedy tokens and logprobs), a bad
update changes nothing, sleep / wake gives the same outputs with no page leak and no compile."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.models import registry
from tokenspeed_jax.runtime.weight_inputs import dotted, hf_tensors

OPTS = dict(
    num_pages=48, page_size=8, max_batch_requests=4, max_scheduled_tokens=64, max_context_len=128,
    lazy_compile="sync",  # compiles counted: none may land in the background
)  # fmt: skip
SP = SamplingParams(max_tokens=8, logprobs=True)
PROMPTS = ["hello world, this is a prompt", "the quick brown fox"]


def _run(llm: LLM, prompts=PROMPTS):
    outs = llm.generate(prompts, SP)
    return [o.token_ids for o in outs], [o.logprobs for o in outs], [o.weight_version for o in outs]


def _params(seed: int):
    return nnx.state(registry.load_builtin("tiny-random", seed=seed)[1], nnx.Param)


@pytest.fixture(scope="module")
def fresh():
    """Outputs of a fresh LLM built from seed 1's weights (the update target)."""
    return _run(LLM("tiny-random", seed=1, **OPTS))


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", seed=0, **OPTS)


def _close(got, want, max_logprob_diff):
    assert got[0] == want[0]
    assert max_logprob_diff(got[1], want[1]) < 1e-4


@pytest.mark.parametrize("form", ["state", "module", "hf_numpy"])
def test_update_equals_fresh_llm(llm, fresh, form, max_logprob_diff):
    old = _run(llm)
    before = llm.weight_version
    if form == "state":
        weights = _params(1)
    elif form == "module":
        weights = registry.load_builtin("tiny-random", seed=1)[1]
    else:
        weights = list(hf_tensors(_params(1)).items())
    compiles = llm.stats()["num_compiles"]
    info = llm.update_weights(weights)
    assert info["weight_version"] == before + 1 == llm.weight_version
    got = _run(llm)
    _close(got, fresh, max_logprob_diff)
    assert got[2] == [before + 1] * len(PROMPTS)
    assert llm.stats()["num_compiles"] == compiles  # the same executables run the new weights
    llm.update_weights(_params(0), weight_version=100)  # back, with a version of our choosing
    back = _run(llm)
    _close(back, old, max_logprob_diff)
    assert back[2] == [100, 100]


@pytest.mark.parametrize(
    "bad, match",
    [
        ([("model.layers.0.mlp.up_proj.weight", np.zeros((3, 3), np.float32))], "up_proj"),
        ([("model.layers.0.mlp.no_such_proj.weight", np.zeros((4, 4), np.float32))], "no_such_proj"),
        ([("layers.0.input_layernorm.weight", np.zeros(64, np.int32))], "input_layernorm.*int32"),
        ([("layers.1.conv.conv_weight", np.zeros((5, 64), np.float32))], "conv_weight"),
        ("/no/such/dir", "not a checkpoint directory"),
        (42, "weights must be"),
    ],
)
def test_bad_update_changes_nothing(llm, bad, match, max_logprob_diff):
    old, version = _run(llm), llm.weight_version
    # a good tensor first: nothing of it may land either
    good = [("layers.0.input_layernorm.weight", np.full(64, 3.0, np.float32))]
    weights = good + bad if isinstance(bad, list) else bad
    with pytest.raises(ValueError, match=match):
        llm.update_weights(weights)
    assert llm.weight_version == version
    _close(_run(llm), old, max_logprob_diff)


def test_partial_update(llm, max_logprob_diff):
    """A subset of modules from seed 1 == a full update with those modules from seed 1."""
    new = dict(nnx.to_flat_state(_params(1)))
    pick = {p: v for p, v in new.items() if p[:3] == ("layers", 2, "mlp") or p[0] == "norm"}
    assert pick
    base = _params(0)
    mixed = [(dotted(p), pick.get(p, v)) for p, v in nnx.to_flat_state(base)]
    ref = LLM("tiny-random", seed=0, **OPTS)
    ref.update_weights(mixed)
    info = llm.update_weights([(dotted(p), v) for p, v in pick.items()])
    assert 0 < info["replaced"] < len(llm.engine.runner.param_leaves)
    _close(_run(llm), _run(ref), max_logprob_diff)
    llm.update_weights(base)


def test_partial_update_of_part_of_a_module_names_the_rest(llm):
    q = dict(nnx.to_flat_state(_params(1)))[("layers", 0, "self_attn", "q_proj", "kernel")]
    attn = llm.engine.runner.params["runs"][0]["self_attn"]  # scan_layers: the CPU default
    fused = attn.get("qkv_proj") is not None
    with pytest.raises(ValueError, match="k_proj" if fused else "q_proj.bias|partial"):
        llm.update_weights([("layers.0.self_attn.q_proj.kernel", q), ("layers.0.self_attn.o_proj.kernel", q)])


@pytest.mark.parametrize("in_flight", ["finish", "abort"])
def test_in_flight_and_prefix_cache(in_flight):
    llm = LLM("tiny-random", seed=0, **OPTS)
    prompt = list(range(40, 80))
    llm.generate([prompt], SamplingParams(max_tokens=2))
    rid = llm.engine.add_request(prompt, SamplingParams(max_tokens=6))
    llm.engine.step()
    info = llm.update_weights(_params(1), in_flight=in_flight)
    (out,) = info["outputs"]
    assert out.request_id == rid and out.weight_version == 0
    assert out.finish_reason == ("length" if in_flight == "finish" else "abort")
    st = llm.stats()
    assert st["free_pages"] == st["total_pages"] and not llm.engine.has_unfinished()
    hits = st["prefix_hit_tokens"]
    llm.generate([prompt], SamplingParams(max_tokens=2))
    assert llm.stats()["prefix_hit_tokens"] == hits  # the old K/V were dropped
    with pytest.raises(ValueError, match="in_flight"):
        llm.update_weights(_params(1), in_flight="later")


def test_sleep_and_wake(max_logprob_diff):
    llm = LLM("tiny-random", seed=0, **OPTS)
    old = _run(llm)
    compiles = llm.stats()["num_compiles"]
    info = llm.sleep()
    assert llm.is_sleeping and info["kv_bytes"] > 0
    assert info["freed_bytes"] >= 0.9 * info["kv_bytes"]
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, SP)
    llm.wake_up()
    assert not llm.is_sleeping
    _close(_run(llm), old, max_logprob_diff)
    st = llm.stats()
    assert st["free_pages"] == st["total_pages"] and st["num_compiles"] == compiles

    # level 2: the weights go too, and come back from the built-in seed
    params = sum(x.nbytes for x in llm.engine.runner.param_leaves)
    info = llm.sleep(level=2)
    assert info["freed_bytes"] >= info["kv_bytes"] + 0.9 * params
    llm.wake_up()
    _close(_run(llm), old, max_logprob_diff)
    assert llm.stats()["num_compiles"] == compiles

    # weights handed over from memory must be handed back
    llm.update_weights(_params(1))
    new = _run(llm)
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="wake_up\\(weights"):
        llm.wake_up()
    llm.wake_up(weights=_params(1))
    _close(_run(llm), new, max_logprob_diff)
    assert llm.weight_version == 1
    # or updated while asleep: wake_up then only restores the pools (no reload from the seed)
    llm.sleep(level=2)
    llm.update_weights(_params(1), weight_version=5)
    llm.wake_up()
    _close(_run(llm), new, max_logprob_diff)
    assert llm.weight_version == 5


def test_no_host_round_trip_for_jax_arrays(llm):
    """A jax array already in our dtype is shared as it is (copy=False) where no transform
    applies (a norm weight), or copied with copy=True."""
    w = jax.numpy.full((64,), 1.5, jax.numpy.float32)
    llm.update_weights([("norm.weight", w)])
    leaf = llm.engine.runner.params["shell"]["norm"]["weight"].get_value()
    assert leaf is w or leaf.unsafe_buffer_pointer() == w.unsafe_buffer_pointer()
    llm.update_weights([("norm.weight", w)], copy=True)
    leaf = llm.engine.runner.params["shell"]["norm"]["weight"].get_value()
    assert leaf.unsafe_buffer_pointer() != w.unsafe_buffer_pointer()
    llm.update_weights(_params(0))


def test_checkpoint_layout_shares_a_trainers_arrays(fresh, max_logprob_diff):
    """weight_layout="checkpoint" (the RL loop's choice): nothing is tiled or fused, so every
    weight of a trainer's `nnx.State` in our dtype is used as it is, none copied; the outputs are
    the default layout's (and scan_layers, which would stack the layers' arrays, stays off)."""
    llm = LLM("tiny-random", seed=0, weight_layout="checkpoint", **OPTS)
    assert not llm.engine.runner.scan_layers
    new = _params(1)
    llm.update_weights(new)
    theirs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(new)}
    leaves = jax.tree_util.tree_leaves_with_path(llm.engine.runner.params)
    # RoPE's inv_freq is a buffer of the model, not a weight: the trainer does not hand it over
    ours = [x.unsafe_buffer_pointer() for p, x in leaves if "inv_freq" not in jax.tree_util.keystr(p)]
    assert len(ours) == len(theirs) and set(ours) == theirs, f"{len(set(ours) - theirs)} weights copied"
    _close(_run(llm), fresh, max_logprob_diff)
