"""Device state layout and pool sizing."""

from __future__ import annotations

import numpy as np
import pytest

from tokenspeed_jax.models import tiny_random_config
from tokenspeed_jax.runtime.device_memory import ALLOCATOR_ENV, DeviceMemory, device_memory
from tokenspeed_jax.runtime.state import (
    CPU_POOL_BUDGET_BYTES,
    bytes_per_page,
    fixed_state_bytes,
    init_state,
    page_bytes_by_pool,
    pages_from_memory,
    split_pool_pages,
)

CFG = tiny_random_config()  # layers: full, conv, sliding, full
LG = (0, 2, 1, 0)
BS = (16, 16, 8)


def test_init_state_shapes_and_null_page():
    st = init_state(CFG, LG, BS, (5, 3, 7), num_pages=11, max_live_requests=4)
    assert [m.shape for m in st.mirrors] == [(4, 5), (4, 3), (4, 7)]
    assert st.caches[0]["k"].shape == (11, 16, 2, 16)
    assert st.caches[1]["conv"].shape == (11, 8, 64)
    assert st.caches[2]["v"].shape == (11, 16, 2, 16)
    assert all(float(np.abs(np.asarray(a[0])).max()) == 0 for c in st.caches for a in c.values())
    with pytest.raises(ValueError):
        init_state(CFG, LG, BS, (5, 3, 7), num_pages=1, max_live_requests=4)


def test_bytes_per_page():
    kv = 16 * 2 * 16 * 4 * 2  # B * Hkv * D * f32 * (k, v)
    assert bytes_per_page(CFG, LG, BS) == 3 * kv + 8 * 64 * 4


class FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_pages_from_memory(monkeypatch):
    per = bytes_per_page(CFG, LG, BS)
    # JAX's allocator capped at 0.8 of the device: 1000 pages' worth of cap = 1250 in all
    monkeypatch.setenv(ALLOCATOR_ENV, "0.8")
    dev = FakeDevice({"bytes_limit": 1000 * per, "bytes_in_use": 200 * per})
    assert device_memory(dev) == DeviceMemory(limit=1000 * per, in_use=200 * per, total=1250 * per)
    assert pages_from_memory(CFG, LG, BS, device=dev, gpu_memory_utilization=0.5) == 625 - 200
    assert pages_from_memory(CFG, LG, BS, device=dev, gpu_memory_utilization=0.9) == 1000 - 200  # the cap
    # the largest step's temporaries and the fixed-size state (mirrors, last tokens, penalty
    # statistics) come out of the budget
    fixed = fixed_state_bytes(CFG, (5, 3, 7), 8)
    assert fixed == 8 * (4 * 15 + 4 + 5 * CFG.vocab_size)
    got = pages_from_memory(
        CFG, LG, BS, device=dev, gpu_memory_utilization=0.5, temp_bytes=7 * per, reserved_bytes=fixed
    )
    assert got == (425 * per - 7 * per - fixed) // per
    monkeypatch.delenv(ALLOCATOR_ENV)  # JAX's own 75%
    assert device_memory(dev).total == int(1000 * per / 0.75)
    cpu = pages_from_memory(CFG, LG, BS, device=FakeDevice(None))
    assert 2 <= cpu <= CPU_POOL_BUDGET_BYTES // per
    assert pages_from_memory(CFG, LG, BS) >= 2  # the real (CPU) device
    # given bytes (kv_cache_memory_bytes) replace both budgets
    for device in (dev, FakeDevice(None)):
        assert pages_from_memory(CFG, LG, BS, device=device, budget_bytes=123 * per + 1) == 123


def test_a_state_pool_of_its_own_sizes_and_splits_the_bytes():
    """tiny-hybrid (Gated DeltaNet + attention): a page id's bytes split into the shared pool's
    (attention K/V) and a snapshot's (the recurrent layers' state); `state_pages` gives the
    recurrent pools their own length; `split_pool_pages` shares a budget between the two."""
    from scheduler.group_spec import group_specs_from_layer_types, layer_group_indices
    from tokenspeed_jax.models.registry import tiny_hybrid_config

    cfg = tiny_hybrid_config()
    specs = group_specs_from_layer_types(layer_types=cfg.layer_types, sliding_window_tokens=None, page_size=4)
    lg, bs = tuple(layer_group_indices(cfg.layer_types, specs)), (4,) * len(specs)
    history, snapshot = page_bytes_by_pool(cfg, lg, bs)
    assert history + snapshot == bytes_per_page(cfg, lg, bs) and history > 0 and snapshot > 0
    assert page_bytes_by_pool(CFG, LG, BS) == (bytes_per_page(CFG, LG, BS), 0)  # nothing recurrent
    st = init_state(cfg, lg, bs, (3,) * len(specs), num_pages=9, max_live_requests=2, state_pages=5)
    rows = {name: a.shape[0] for c in st.caches for name, a in c.items()}
    assert rows == {"k": 9, "v": 9, "ssm": 5, "conv_state": 5}
    with pytest.raises(ValueError, match="state_pages must be >= 2"):
        init_state(cfg, lg, bs, (3,) * len(specs), num_pages=9, max_live_requests=2, state_pages=1)
    # half of 1000 snapshots' bytes -> 500 snapshots, the rest in shared pages; a floor of 600
    # snapshots takes more; a floor that leaves no shared page falls back (None)
    budget = 1000 * snapshot
    assert split_pool_pages(budget, history, snapshot, share=0.5, min_state_pages=10) == (
        500 * snapshot // history,
        500,
    )
    assert split_pool_pages(budget, history, snapshot, share=0.5, min_state_pages=600)[1] == 600
    assert split_pool_pages(budget, history, snapshot, share=0.5, min_state_pages=1000) is None
