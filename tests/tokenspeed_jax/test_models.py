"""Paged forward == dense forward of the same params (chunked prefill, decode, holes, reuse)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scheduler import SchedulerConfig, cache_layout
from tokenspeed_jax.models import build_model, tiny_random_config
from tokenspeed_jax.models.batch import make_paged_batch
from tokenspeed_jax.runtime.backends import get_paged_attention, get_short_conv
from tokenspeed_jax.runtime.state import init_state

WINDOW = 6  # sliding window (tokens) < prompt lengths, not a multiple of the page size
PAGE = 4  # attention page size
CONV_PAGE = 2  # conv group page size: live-tail leaves holes between the resume pages
NUM_PAGES = 48
T_BUCKET = 16


class HostTables:
    """Minimal host page manager for the test: full, sliding (reclaim), live-tail conv rows."""

    def __init__(self, groups, num_slots, width):
        self.groups = groups  # list of (kind, block, window)
        self.free = list(range(1, NUM_PAGES))
        self.rows = [np.zeros((num_slots, width[g]), np.int32) for g in range(len(groups))]
        self.nslots = [[0] * num_slots for _ in groups]
        self.align = math.lcm(*(b for _, b, _ in groups))

    def prepare(self, slot, start, end):
        """Before computing tokens [start, end) of the request in `slot`."""
        for g, (kind, b, w) in enumerate(self.groups):
            row = self.rows[g][slot]
            if kind != "full":  # reclaim slots fully slid out at extent `start`
                for s in range(max(0, (start - w + 1) // b)):
                    if row[s]:
                        self.free.insert(0, int(row[s]))  # reused first: stale data everywhere
                        row[s] = 0
            while self.nslots[g][slot] * b < end:
                s = self.nslots[g][slot]
                real = True
                if kind == "conv":
                    per = self.align // b
                    real = s >= (end - w + 1) // b or s % per >= per - math.ceil((w - 1) / b)
                row[s] = self.free.pop(0) if real else 0
                self.nslots[g][slot] += 1


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_random_config(sliding_window=WINDOW)
    model = build_model(cfg, seed=0)
    layout = cache_layout(SchedulerConfig(NUM_PAGES, page_size=PAGE), cfg, conv_page_size=CONV_PAGE)
    return cfg, model, layout.scheduler_config.groups, layout.layer_groups


def test_group_specs_and_layer_mapping(setup):
    cfg, _, specs, lg = setup
    kinds = {
        t: (specs[g].retention, specs[g].sliding_window_tokens, specs[g].live_tail_alloc)
        for t, g in zip(cfg.layer_types, lg, strict=True)
    }
    assert kinds["full_attention"] == ("full_history", None, False)
    assert kinds["sliding_attention"] == ("sliding_window", WINDOW, False)
    assert kinds["conv"] == ("sliding_window", cfg.conv_L_cache, True)


def test_tiny_random_is_deterministic_and_not_flat(setup):
    cfg, model, _, _ = setup
    ids = jnp.arange(40, dtype=jnp.int32) * 7 % 256
    logits = np.asarray(model.dense(ids))
    again = np.asarray(build_model(cfg, seed=0).dense(ids))
    other = np.asarray(build_model(cfg, seed=1).dense(ids))
    np.testing.assert_array_equal(logits, again)
    assert np.abs(logits - other).max() > 1.0
    probs = jax.nn.softmax(logits, axis=-1)
    assert float(probs.max(-1).mean()) > 0.1  # peaked, not ~1/260
    assert len(set(logits.argmax(-1).tolist())) > 3


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_paged_forward_matches_dense(setup, backend):
    """pallas runs the kernels of pallas_kernels (interpret mode off GPU)."""
    cfg, model, specs, lg = setup
    kinds = []
    for s in specs:
        kind = "full" if s.retention == "full_history" else "conv" if s.live_tail_alloc else "sw"
        kinds.append((kind, s.page_size, s.sliding_window_tokens))
    page_sizes = tuple(b for _, b, _ in kinds)
    num_slots, ctx = 4, 24
    widths = tuple(-(-ctx // b) for b in page_sizes)
    host = HostTables(kinds, num_slots, widths)

    rng = np.random.default_rng(0)
    seqs = {0: rng.integers(0, 256, 17), 2: rng.integers(0, 256, 14), 3: rng.integers(0, 256, 9)}
    dense_fn = jax.jit(model.dense)
    dense = {s: np.asarray(dense_fn(jnp.asarray(ids, jnp.int32))) for s, ids in seqs.items()}
    # Steps: (slot, num_tokens) per row; chunks both aligned and not, then decodes.
    steps = [[(0, 5), (2, 9)], [(0, 7), (2, 1), (3, 6)], [(3, 3), (0, 1), (2, 1)], [(0, 4), (2, 3)]]
    state = init_state(cfg, lg, page_sizes, widths, num_pages=NUM_PAGES, max_live_requests=4)
    # Garbage everywhere except the null page: nothing may read an unwritten page.
    caches = jax.tree.map(lambda a: a.at[1:].set(jnp.nan), state.caches)
    done = dict.fromkeys(seqs, 0)
    attn, conv = get_paged_attention(backend), get_short_conv(backend)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def fwd(token_ids, caches, mirrors, slots, qs, kv, pos, trows):
        batch = make_paged_batch(
            mirrors, slots, qs, kv, pos, trows, page_sizes=page_sizes, num_pages=NUM_PAGES, layer_groups=lg
        )
        hidden, caches = model(token_ids, caches, batch, attn, conv)
        return model.logits(hidden), caches

    r = 3
    for step in steps:
        slots = np.full(r, -1, np.int32)
        qs = np.zeros(r + 1, np.int32)
        kv = np.zeros(r, np.int32)
        tok, pos, trows = [], [], []
        for i, (slot, n) in enumerate(step):
            start = done[slot]
            host.prepare(slot, start, start + n)
            slots[i], kv[i] = slot, start + n
            tok += list(seqs[slot][start : start + n])
            pos += list(range(start, start + n))
            trows += [i] * n
            qs[i + 1] = qs[i] + n
        qs[len(step) + 1 :] = qs[len(step)]
        pad = T_BUCKET - len(tok)
        logits, caches = fwd(
            jnp.asarray(tok + [0] * pad, jnp.int32),
            caches,
            tuple(jnp.asarray(m) for m in host.rows),
            jnp.asarray(slots),
            jnp.asarray(qs),
            jnp.asarray(kv),
            jnp.asarray(pos + [0] * pad, jnp.int32),
            jnp.asarray(trows + [r] * pad, jnp.int32),
        )
        logits = np.asarray(logits)
        assert np.isfinite(logits[: len(tok)]).all()
        for i, (slot, n) in enumerate(step):
            got = logits[qs[i] : qs[i + 1]]
            want = dense[slot][done[slot] : done[slot] + n]
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
            done[slot] += n
    assert all(done[s] == len(seqs[s]) for s in seqs)
    # The scenario really exercised holes (conv live-tail, sliding reclaim) and page reuse.
    conv_g = [k for k, _, _ in kinds].index("conv")
    sw_g = [k for k, _, _ in kinds].index("sw")
    assert (host.rows[conv_g][0, : host.nslots[conv_g][0]] == 0).any()
    assert (host.rows[sw_g][0, : host.nslots[sw_g][0]] == 0).any()


def test_stale_mirror_corrupts(setup):
    """Writes go where the mirror says: two logical pages aliased on one page corrupt logits."""
    cfg, model, specs, lg = setup
    page_sizes = tuple(s.page_size for s in specs)
    widths = tuple(-(-16 // b) for b in page_sizes)
    state = init_state(cfg, lg, page_sizes, widths, num_pages=NUM_PAGES, max_live_requests=1)
    ids = np.arange(3, 15, dtype=np.int32)
    dense = np.asarray(model.dense(jnp.asarray(ids)))
    attn = get_paged_attention("reference")

    @jax.jit
    def fwd(mirrors):
        batch = make_paged_batch(
            mirrors,
            jnp.asarray([0]),
            jnp.asarray([0, 12]),
            jnp.asarray([12]),
            jnp.arange(12, dtype=jnp.int32),
            jnp.zeros(12, jnp.int32),
            page_sizes=page_sizes,
            num_pages=NUM_PAGES,
            layer_groups=lg,
        )
        hidden, _ = model(jnp.asarray(ids), state.caches, batch, attn)
        return model.logits(hidden)

    def run(rows):
        return np.asarray(fwd(tuple(jnp.asarray(m[None, : widths[g]]) for g, m in enumerate(rows))))

    good = [np.arange(1, 9, dtype=np.int32) + 10 * g for g in range(len(specs))]
    np.testing.assert_allclose(run(good), dense, atol=1e-5)
    bad = [r.copy() for r in good]
    full_g = lg[0]
    bad[full_g][2] = bad[full_g][0]  # logical pages 0 and 2 alias one physical page
    assert np.abs(run(bad) - dense).max() > 1e-2


def test_write_idx_drops_holes_padding_and_columns_past_the_row():
    """Token writes go to `page * B + pos % B`; holes, padding and columns >= W go out of range."""
    mirror = jnp.array([[0, 7, 3], [5, 0, 0]], jnp.int32)  # slot 0: hole at column 0
    rows = jnp.array([0, 1, 0, 0, 2, 3], jnp.int32)  # row 2: slot -1; row 3 = R: padding token
    positions = jnp.array([9, 1, 3, 24, 0, 0], jnp.int32)
    batch = make_paged_batch(
        (mirror,),
        jnp.array([0, 1, -1]),
        jnp.array([0, 4, 5, 6]),
        jnp.array([25, 2, 1]),
        positions,
        rows,
        page_sizes=(8,),
        num_pages=10,
        layer_groups=(0,),
    )
    # slot 0 column 1 (page 7); slot 1 column 0 (page 5); hole; past W = 3; padding row; padding
    np.testing.assert_array_equal(np.asarray(batch.write_idx[0]), [57, 41, 80, 80, 80, 80])
