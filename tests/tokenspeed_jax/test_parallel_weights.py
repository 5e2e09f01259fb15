"""update_weights / sleep / wake_up under tensor parallelism (issue 48), in the 4-device
subprocess of `parallel_worker.py` (group "weights"): tp=2 plain and tp=2 with int8 weights and
q/k/v + gate/up fused for the shards, and dp=2 (== tp=1). After the update, greedy tokens, logprobs and prompt
logprobs equal a fresh tp=2 LLM of the new weights (1e-4) and the outputs carry version 1;
after sleep / wake the same again; params keep their shardings, nothing recompiles, no page
leaks and sleeping frees the pools."""

from __future__ import annotations

import pytest

from tests.tokenspeed_jax.parallel_worker import check_same_outputs, run_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result() -> dict:
    return run_worker("weights")


@pytest.mark.parametrize("tag", ["tp2", "tp2_int8_fused"])
def test_update_and_wake_equal_fresh(result, tag, max_logprob_diff):
    assert result["runs"][tag]["tokens"] != result["runs"][f"{tag}_seed1"]["tokens"]
    for after in ("updated", "woken"):
        check_same_outputs(result, f"{tag}_{after}", f"{tag}_seed1", max_logprob_diff)
        assert result["runs"][f"{tag}_{after}"]["versions"] == [1]


@pytest.mark.parametrize("tag", ["tp2", "tp2_int8_fused"])
def test_layout_kept(result, tag):
    c = result["checks"][tag]
    assert 0 < c["replaced"] <= c["leaves"]
    assert c["same_shardings"] and c["sharded"] > 0
    assert c["fused"] == ("fused" in tag)
    assert c["compiles_same"] and c["pages_free"] and c["kv_freed"]


def test_data_parallel_update(result, max_logprob_diff):
    check_same_outputs(result, "dp2_updated", "tp1_seed1", max_logprob_diff)
    assert result["runs"]["dp2_updated"]["versions"] == [1]
    first, second = result["dp2_devices"]
    assert len(first) == len(second) == 1 and first != second  # each replica kept its device
