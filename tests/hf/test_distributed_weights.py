"""Per-shard weight loading (multi-process runs, docs/distributed.md): lazy `ParamSource`s read
or generate only the slice a device holds, with the eager loader's values.

* `CheckpointSource.read` of every tp=4 shard equals the eager transform's slice, and reads
  exactly that slice's bytes from the file (twice them for GPT-OSS's interleaved gate/up).
* Every family's lazy load (after KV-head replication and the conv gate re-layout for tp=4)
  gives each shard the eager model's values bitwise, and the four shards together read the
  sharded tensors once (each ~1/4) plus every replicated tensor per shard.
* The built-in random model generated lazily equals the eager init within 1e-6.
The two-process run (`tests/tokenspeed_jax/test_distributed.py`) measures the bytes each
process reads and checks the tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from tokenspeed_jax.runtime import param_sources as ps

TP = 4


def _shard_index(shape, spec, s: int):
    """The index tuple of shard s of a tp=TP NamedSharding with PartitionSpec `spec`."""
    out = []
    for n, ax in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        out.append(slice(s * n // TP, (s + 1) * n // TP) if ax is not None else slice(0, n))
    return tuple(out)


def test_checkpoint_source_reads_only_its_slice(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    w = rng.standard_normal((12, 8)).astype(np.float32)  # HF [out, in]
    conv = rng.standard_normal((8, 1, 3)).astype(np.float32)  # LFM2 [H, 1, K]
    gu = rng.standard_normal((2, 4, 16)).astype(np.float32)  # GPT-OSS [E, H, 2I]
    f = str(tmp_path / "m.safetensors")
    save_file({"w": w, "conv": conv, "gu": gu}, f)
    src = {n: ps.CheckpointSource(f, n, a.shape, a.dtype) for n, a in (("w", w), ("conv", conv), ("gu", gu))}
    perm = rng.permutation(12)
    cases = [  # (lazy source, eager array, sharded axis, bytes read per element needed)
        (src["w"].T, w.T, 1, 1),
        (src["w"].T.take(1, perm), w.T[:, perm], 1, 1),
        (src["conv"].reshape(8, -1).T, conv.reshape(8, -1).T, 1, 1),
        (src["gu"][..., 0::2], gu[..., 0::2], 2, 2),
        (src["w"].astype(np.float16), w.astype(np.float16), 0, 1),
    ]
    for lazy, eager, axis, factor in cases:
        assert lazy.shape == eager.shape and lazy.dtype == eager.dtype
        for s in range(TP):
            spec = [None] * eager.ndim
            spec[axis] = "tp"
            index = _shard_index(eager.shape, spec, s)
            ps.reset_stats()
            got = lazy.read(index)
            np.testing.assert_array_equal(got, eager[index])
            want = eager[index].size * np.dtype(lazy.file_dtype).itemsize
            # a permuted shard may need up to one extra element per gap (merged runs)
            assert want <= ps.READ_STATS["checkpoint_bytes"] <= factor * want + 4 * eager[index].shape[0] * 4


@pytest.mark.parametrize("family", ["llama", "qwen3", "lfm2", "gpt_oss"])
def test_lazy_checkpoint_shards_equal_eager(hf_checkpoints, family):
    from flax import nnx

    from tokenspeed_jax.hf import load_checkpoint
    from tokenspeed_jax.runtime import sharding

    path = hf_checkpoints[family][0]
    cfg, eager, _ = load_checkpoint(path)
    _, lazy, _ = load_checkpoint(path, lazy=True)
    tp = TP
    for net in (eager, lazy):
        rc = sharding.replicate_kv_heads(net, cfg, tp)
        sharding.relayout_conv(net, tp)
    rules = sharding.TensorParallel.__new__(sharding.TensorParallel)
    rules.shard_vocab = cfg.vocab_size % tp == 0
    sharding.validate(rc, tp)
    e_flat = dict(nnx.to_flat_state(nnx.split(eager, nnx.Param, ...)[1]))
    l_flat = dict(nnx.to_flat_state(nnx.split(lazy, nnx.Param, ...)[1]))
    assert e_flat.keys() == l_flat.keys()
    ps.reset_stats()
    total = sharded = 0
    for path_, var in l_flat.items():
        src, want = var.get_value(), np.asarray(e_flat[path_].get_value())
        assert isinstance(src, ps.CheckpointSource), path_
        spec = rules.spec_for("/".join(map(str, path_)), src.ndim)
        total += want.nbytes
        sharded += want.nbytes if len(spec) and any(a is not None for a in spec) else 0
        for s in range(tp):
            index = _shard_index(want.shape, spec, s)
            np.testing.assert_array_equal(src.read(index), want[index], err_msg=str(path_))
    read = ps.READ_STATS["checkpoint_bytes"]
    replicated = total - sharded
    # every shard reads its 1/tp of the sharded tensors (KV heads: the head it holds, read once per
    # shard although two shards share it; GPT-OSS gate/up: both halves) + the replicated ones
    slack = 2 if family == "gpt_oss" else 1
    assert read >= sharded + tp * replicated * 0.99
    assert read <= slack * sharded * 1.3 + tp * replicated, (read, sharded, replicated)


def test_generated_tiny_model_equals_eager():
    from flax import nnx

    from tokenspeed_jax.models import registry

    cfg = registry.tiny_random_config()
    eager = registry.build_model(cfg, 0)
    lazy = ps.generated_model(lambda: registry.build_model(cfg, 0))
    e_flat = dict(nnx.to_flat_state(nnx.split(eager, nnx.Param, ...)[1]))
    leaves = [var.get_value() for var in dict(nnx.to_flat_state(nnx.split(lazy, nnx.Param, ...)[1])).values()]
    assert all(isinstance(x, ps.GeneratedSource) for x in leaves)
    import jax

    rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = ps.place_sources(leaves, [rep] * len(leaves))
    for (path_, var), x in zip(e_flat.items(), got):
        # jit fuses the init's scaling differently from eager ops: a few ulps
        np.testing.assert_allclose(np.asarray(x), np.asarray(var.get_value()), atol=1e-6, err_msg=str(path_))
