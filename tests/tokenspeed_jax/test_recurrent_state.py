"""Both recurrent mixers (Gated DeltaNet, Mamba2) over state pools full of NaN garbage: a fresh
row (its state_read is the null page), a decode row resuming from a real snapshot, a prefill row
crossing page ends, and a padding row. Outputs equal the same step over a clean pool (zeros where
the garbage was), and the step writes exactly the row-final and page-end pages."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.models.batch import make_paged_batch
from tokenspeed_jax.models.gated_delta import GatedDeltaNet
from tokenspeed_jax.models.gated_delta import state_pool_shapes as gdn_pools
from tokenspeed_jax.models.mamba2 import Mamba2Mixer
from tokenspeed_jax.models.mamba2 import state_pool_shapes as mamba_pools
from tokenspeed_jax.models.registry import tiny_hybrid_config

PAGE, NUM_PAGES = 4, 16


def _mamba_config():
    return dataclasses.replace(
        tiny_hybrid_config(), layer_types=("mamba", "full_attention"), mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=8,
    )  # fmt: skip


MIXERS = {
    "gated_delta": (tiny_hybrid_config, GatedDeltaNet, gdn_pools),
    "mamba2": (_mamba_config, Mamba2Mixer, mamba_pools),
}


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_garbage_in_unused_and_null_state_pages_never_leaks(name):
    make_cfg, mixer_cls, pool_shapes = MIXERS[name]
    cfg = make_cfg()
    mixer = mixer_cls(cfg, rngs=nnx.Rngs(0))
    # rows: 0 a fresh prompt of 6 tokens (slots 0, 1 -> pages 1, 2); 1 a decode at position 9
    # (cached 0..8, its state after token 8 in page 5, slot 2's); 2 a prefill of positions 2..6
    # (cached 0..1, its state in page 7, slot 0's); 3 padding
    mirror = np.zeros((4, 8), np.int32)
    mirror[0, :2] = [1, 2]
    mirror[1, :3] = [3, 4, 5]
    mirror[2, :2] = [7, 8]
    req_slots = jnp.asarray([0, 1, 2, -1], jnp.int32)
    q_lens, kv_lens = [6, 1, 5, 0], [6, 10, 7, 0]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    t = 16
    positions = np.zeros(t, np.int32)
    rows = np.full(t, 4, np.int32)
    for r, (q, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        positions[cu[r] : cu[r + 1]] = np.arange(kv - q, kv)
        rows[cu[r] : cu[r + 1]] = r
    batch = make_paged_batch(
        (jnp.asarray(mirror),), req_slots, cu, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(positions),
        jnp.asarray(rows), page_sizes=(PAGE,), num_pages=NUM_PAGES, layer_groups=(0,),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    shapes = pool_shapes(cfg, NUM_PAGES)
    clean = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    for k, s in shapes.items():
        clean[k][5] = rng.normal(size=s[1:])  # row 1's snapshot
        clean[k][7] = rng.normal(size=s[1:])  # row 2's
    dirty = {k: v.copy() for k, v in clean.items()}
    for k in dirty:
        keep = np.zeros(NUM_PAGES, bool)
        keep[[5, 7]] = True
        dirty[k][~keep] = np.nan  # the null page, free pages, pages about to be written
    x = jnp.asarray(rng.normal(size=(t, cfg.hidden_size)), jnp.float32)
    step = jax.jit(lambda x, c, b: mixer.paged(x, c, b, 0))
    y_clean, new_clean = step(x, {k: jnp.asarray(v) for k, v in clean.items()}, batch)
    y_dirty, new_dirty = step(x, {k: jnp.asarray(v) for k, v in dirty.items()}, batch)
    real = int(cu[-1])
    assert np.isfinite(np.asarray(y_dirty[:real])).all()
    np.testing.assert_allclose(y_dirty[:real], y_clean[:real], atol=1e-6)
    written: set[int] = set()
    for k in shapes:
        new_d, new_c = np.asarray(new_dirty[k]), np.asarray(new_clean[k])
        changed = {p for p in range(NUM_PAGES) if not np.array_equal(new_c[p], clean[k][p])}
        written |= changed
        for p in changed:  # what a step writes is computed from clean inputs only
            np.testing.assert_allclose(new_d[p], new_c[p], atol=1e-6)
        untouched = [p for p in range(NUM_PAGES) if p not in changed]
        np.testing.assert_array_equal(np.isnan(new_d[untouched]), np.isnan(dirty[k][untouched]))
    # page ends: row 0's position 3 (page 1), row 2's position 3 (page 7); row-final states: row 0
    # in page 2, row 1 in page 5 (slot 2), row 2 in page 8 (slot 1). Nothing else.
    assert written == {1, 2, 5, 7, 8}


def test_each_group_drops_its_writes_at_its_own_pool_length():
    """With a state pool of its own, a state group's padding / hole writes point one past that
    pool, not past the shared one: a state pool larger than the shared pool would otherwise take
    the shared length as a real page id and overwrite a snapshot."""
    mirrors = (jnp.asarray([[1, 2, 0]], jnp.int32), jnp.asarray([[3, 0, 0]], jnp.int32))
    cu = jnp.asarray([0, 3, 3], jnp.int32)
    kv_lens = jnp.asarray([3, 0], jnp.int32)
    positions = jnp.asarray([0, 1, 2, 0], jnp.int32)
    rows = jnp.asarray([0, 0, 0, 2], jnp.int32)  # the last token is padding
    kw = dict(page_sizes=(4, 4), num_pages=10, layer_groups=(0, 1))
    batch = make_paged_batch(mirrors, jnp.asarray([0, -1], jnp.int32), cu, kv_lens, positions, rows,
                             group_pages=(10, 25), **kw)  # fmt: skip
    assert np.asarray(batch.write_idx[0]).tolist() == [4, 5, 6, 40]
    assert np.asarray(batch.write_idx[1]).tolist() == [12, 13, 14, 100]
    assert np.asarray(batch.state_write[1]).tolist() == [3, 25]  # row 1 is padding
    shared = make_paged_batch(mirrors, jnp.asarray([0, -1], jnp.int32), cu, kv_lens, positions, rows, **kw)
    assert np.asarray(shared.state_write[1]).tolist() == [3, 10]
