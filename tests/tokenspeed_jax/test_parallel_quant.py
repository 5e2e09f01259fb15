"""Tensor parallel with quantized KV caches and weights, and with the Pallas kernels, on 4 virtual
CPU devices (the worker: `parallel_worker.py`, group "quant"; tp / dp / scan: test_parallel.py):

- tp=2 == tp=1 (tokens, logprobs, prompt logprobs within 1e-4) for an int8 KV cache, w8a8 and
  Q8_0 weights, and the Pallas kernels (interpret mode) under shard_map; tp=2 Pallas == the
  single-device reference backend;
- int8 pools and their f16 scale pools split on kv heads; Q8_0 block scales split like their
  kernels (columns, or input blocks).
"""

from __future__ import annotations

import pytest

from tests.tokenspeed_jax.parallel_worker import check_same_outputs, run_worker

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it in the inner loop; CI runs it


@pytest.fixture(scope="module")
def result() -> dict:
    return run_worker("quant")


@pytest.mark.parametrize(
    "name,base",
    [
        ("tp2_pallas", "tp1_pallas"),
        ("tp2_int8", "tp1_int8"),
        ("tp2_w8a8", "tp1_w8a8"),
        ("tp2_q8_0", "tp1_q8_0"),
        ("tp2_fused", "tp1"),
        ("tp2_w8a8_fused", "tp1_w8a8"),
    ],
)
def test_parallel_matches_single_device(result, name, base, max_logprob_diff):
    check_same_outputs(result, name, base, max_logprob_diff)


def test_q8_0_block_scales_split_with_their_kernels(result):
    shards = result["q8_0_shards"]
    q = next(v for k, v in shards.items() if "q_proj" in k)
    o = next(v for k, v in shards.items() if "o_proj" in k)
    assert q[1] == [q[0][0], q[0][1] // 2]  # column-parallel: split on out
    assert o[1] == [o[0][0] // 2, o[0][1]]  # row-parallel: split on input blocks


def test_pallas_tp_matches_reference(result, max_logprob_diff):
    """shard_map'd Pallas kernels (interpret mode) == the single-device reference backend."""
    a, b = result["runs"]["tp1_ref3"], result["runs"]["tp2_pallas"]
    assert b["tokens"][:3] == a["tokens"][:3]
    assert max_logprob_diff(b["logprobs"][:3], a["logprobs"][:3]) < 1e-4


def test_quantized_pools_are_sharded(result):
    """int8 values and f16 scales (uint16 bits on the reference backend) split on kv heads."""
    q = result["int8_shards"]
    assert q["cache0.k"] == [[160, 4, 2, 16], [[160, 4, 1, 16]] * 2, "int8"]
    assert q["cache0.k_scale"] == q["cache0.v_scale"] == [[160, 4, 2], [[160, 4, 1]] * 2, "uint16"]


def test_fused_projections_are_column_sharded(result):
    """qkv_proj [64, 64 + 32 + 32] and gate_up_proj [64, 2 * 128]: each shard holds half the
    columns (its own q, k, v heads; its own gate and up channels)."""
    shards = result["fused_shards"]
    kernels = {k: v for k, v in shards.items() if "['kernel']" in k}
    qkv = [v for k, v in kernels.items() if "qkv_proj" in k]
    gate_up = [v for k, v in kernels.items() if "gate_up_proj" in k]
    assert qkv and gate_up
    assert all(v == [[64, 128], [64, 64]] for v in qkv), qkv
    assert all(v == [[64, 256], [64, 128]] for v in gate_up), gate_up
