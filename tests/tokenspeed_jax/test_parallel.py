"""Tensor- and data-parallel serving on 4 virtual CPU devices.

The work runs in a 4-device subprocess (`parallel_worker.py`, group "core"); the assertions run
here on its JSON record (quantized KV / weights and the Pallas kernels: test_parallel_quant.py):

- greedy tokens, logprobs and prompt logprobs of tp=2, dp=2 and tp=2 x dp=2 == tp=1 (1e-4),
  with the reference backend, and tp=2 == tp=1 on the Gated DeltaNet hybrid (tiny-hybrid, its heads sharded);
- params and pools really are sharded (specs and per-device shard shapes);
- dp: both replicas served requests, `stats()` sums them, `engine` is `engines[0]`;
- scan_layers under tp=2: same tokens, stacked params and pools sharded like their layer's;
- one compile per token bucket per replica (the sharded state keeps its sharding across steps);
- a second tp=1 LLM loads its steps from the executable store onto one of the 4 devices;
- an MoE + sinks + biases config: sharded forward == unsharded (ragged_dot over sharded experts);
- the recurrent mixers heads-sharded: tiny-hybrid's params and state pools split, a Mamba2 +
  Gated DeltaNet config's sharded forward == unsharded (tp 2 and 4, B / C groups replicated);
- bad sizes raise ValueError (tp=3 with 2 kv heads, tp*dp > devices, tp=0).
"""

from __future__ import annotations

import pytest

from tests.tokenspeed_jax.parallel_worker import check_same_outputs, run_worker

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it in the inner loop; CI runs it


@pytest.fixture(scope="module")
def result() -> dict:
    return run_worker("core")


@pytest.mark.parametrize(
    "name,base",
    [("tp2", "tp1"), ("tp2dp2", "tp1"), ("dp2", "tp1"), ("tp2_scan", "tp1"), ("tp1_warm", "tp1"),
     ("hybrid_tp2", "hybrid_tp1")],
)  # fmt: skip
def test_parallel_matches_single_device(result, name, base, max_logprob_diff):
    check_same_outputs(result, name, base, max_logprob_diff)


def test_one_compile_per_bucket_per_replica(result):
    """Sharded state comes back with the sharding it went in with: no recompiles."""
    runs = result["runs"]
    single = runs["tp1"]["compiles"]
    assert runs["tp2"]["compiles"] == single
    assert runs["tp2dp2"]["compiles"] == runs["dp2"]["compiles"] == single * 2


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


def test_recurrent_layers_are_head_sharded(result):
    """tiny-hybrid under tp=2 (its tokens == tp=1 above): the Gated DeltaNet projections, conv,
    state and conv-tail pools hold half the heads / channels on each device."""
    sh = result["hybrid_shards"]

    def shard_of(part):
        keys = [k for k in sh if part in k]
        assert keys, part
        return [sh[k] for k in keys]

    # tiny-hybrid: Hk = 2 key heads, Hv = 4 value heads of 16, conv channels 2*32 + 64 = 128
    assert shard_of("['in_proj_qkv']['kernel']")[0] == [[64, 128], [64, 64]]
    assert shard_of("['in_proj_z']['kernel']")[0] == [[64, 64], [64, 32]]
    assert shard_of("['out_proj']['kernel']")[0] == [[64, 64], [32, 64]]
    assert shard_of("['conv_weight']")[0] == [[4, 128], [4, 64]]
    for shape, shard in shard_of("['ssm']"):  # f32[P, Hv, Dk, Dv] on Hv
        assert shard == [shape[0], 2, 16, 16]
    for shape, shard in shard_of("['conv_state']"):  # f32[P, K-1, C] on C
        assert shard == [shape[0], 3, 64]


@pytest.mark.parametrize("case", ["tp2_g2", "tp4_g2", "tp2_g1"])
def test_mamba2_and_delta_sharded_forward(result, case):
    """Mamba2 + Gated DeltaNet + attention, heads sharded (B / C groups split, or replicated when
    tp > groups): the logits equal the unsharded forward's, and no all-gather runs."""
    maxdiff, gathers = result["recurrent_maxdiff"][case]
    assert maxdiff < 1e-4 and gathers == 0


def test_bad_sizes_raise(result):
    err = result["errors"]
    assert err["tp3"] is not None and "num_key_value_heads=2" in err["tp3"]
    assert err["tp4dp2"] is not None and "exceeds the 4 available" in err["tp4dp2"]
    assert err["tp0"] is not None


def test_single_device_executables_load_on_one_of_many_devices(result):
    """A stored one-device step loads onto the default device, not spread over all four (which
    failed at its first call: "Expected args ... to have 4 shards")."""
    assert result["tp1_warm_loaded"] > 0
