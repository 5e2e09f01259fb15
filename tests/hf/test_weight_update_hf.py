"""LLM.update_weights on a tiny Hugging Face Llama checkpoint (biases, tied table), float and
int8 weights, q/k/v and gate/up fused (the accelerator default, forced here on CPU too): an
update from a directory or from (HF name, array) pairs gives what a fresh LLM of the new
checkpoint gives (issue 48)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from tests.tokenspeed_jax.conftest import _max_logprob_diff as max_diff
from tokenspeed_jax import LLM, SamplingParams

pytest.importorskip("torch")
pytest.importorskip("transformers")

OPTS = dict(
    num_pages=48, page_size=8, max_batch_requests=4, max_scheduled_tokens=64, max_context_len=128,
    lazy_compile="sync",  # compiles counted: none may land in the background
)  # fmt: skip
SP = SamplingParams(max_tokens=8, logprobs=True)
PROMPTS = [[5, 17, 99, 230, 7, 64, 12], [300, 2, 44, 81]]


def _tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(A, B): the tiny llama checkpoint and a copy with every tensor perturbed."""
    from safetensors.numpy import save_file

    from tests.hf.checkpoints import build_checkpoint, family_configs

    root = tmp_path_factory.mktemp("wu")
    a, b = str(root / "a"), str(root / "b")
    build_checkpoint("llama", family_configs()["llama"], a)
    shutil.copytree(a, b)
    rng = np.random.default_rng(7)
    for f in os.listdir(b):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(b, f))
    new = {k: (v + rng.normal(0, 0.2, v.shape)).astype(v.dtype) for k, v in _tensors(a).items()}
    save_file(new, os.path.join(b, "model.safetensors"))
    return a, b


def _run(llm: LLM):
    outs = llm.generate(PROMPTS, SP)
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_update_from_dir_and_pairs_equals_fresh(checkpoints, quantization, monkeypatch):
    from tokenspeed_jax.runtime import prepare

    monkeypatch.setattr(prepare, "fuse_by_default", lambda platform: True)  # as on accelerators
    a, b = checkpoints
    want = _run(LLM(b, quantization=quantization, **OPTS))
    llm = LLM(a, quantization=quantization, **OPTS)
    attn = llm.engine.runner.params["runs"][0]["self_attn"]  # scan_layers (the CPU default)
    assert "qkv_proj" in attn and "q_proj" not in attn  # q/k/v fused into one prepared tensor
    old = _run(llm)
    assert old[0] != want[0]
    compiles = llm.stats()["num_compiles"]
    llm.update_weights(b)
    got = _run(llm)
    assert got[0] == want[0] and max_diff(got[1], want[1]) < 1e-4
    llm.update_weights(list(_tensors(a).items()))  # (HF name, numpy) pairs: back to A
    back = _run(llm)
    assert back[0] == old[0] and max_diff(back[1], old[1]) < 1e-4
    assert llm.stats()["num_compiles"] == compiles and llm.weight_version == 2
    # a bad tensor in a checkpoint-shaped update: named, nothing changed
    bad = _tensors(b)
    bad["model.layers.1.self_attn.v_proj.bias"] = bad["model.layers.1.self_attn.v_proj.bias"][:-1]
    with pytest.raises(ValueError, match="layers.1.self_attn.v_proj.bias"):
        llm.update_weights(bad.items())
    again = _run(llm)
    assert again[0] == old[0] and llm.weight_version == 2


def test_partial_update_under_scan_layers(checkpoints):
    """scan_layers stacks the 3 layers' weights into one array per tensor: an update naming
    only layer 1's MLP (and the final norm) replaces layer 1 inside each stack and leaves
    layers 0 and 2, as the same update does without scan."""
    a, b = checkpoints
    new = _tensors(b)
    pick = [(k, v) for k, v in new.items() if k.startswith("model.layers.1.mlp.") or k == "model.norm.weight"]
    assert len(pick) == 7  # gate / up / down kernels and biases, the norm
    plain, scanned = LLM(a, scan_layers=False, **OPTS), LLM(a, scan_layers=True, **OPTS)
    assert [r.size for r in scanned.engine.runner.scan_runs] == [3]
    before = _run(scanned)
    down = scanned.engine.runner.params["runs"][0]["mlp"]["down_proj"]["kernel"][...]
    for llm in (plain, scanned):
        llm.update_weights(pick)
    got, want = _run(scanned), _run(plain)
    assert got[0] == want[0] and max_diff(got[1], want[1]) < 1e-4
    assert got[0] != before[0]
    after = scanned.engine.runner.params["runs"][0]["mlp"]["down_proj"]["kernel"][...]
    np.testing.assert_array_equal(after[0], down[0])
    np.testing.assert_array_equal(after[2], down[2])
    assert not np.array_equal(after[1], down[1])
