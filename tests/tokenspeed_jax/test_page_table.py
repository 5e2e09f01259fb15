"""update_rows: the DESIGN.md §6 cases literally, the numpy oracle under hypothesis, one compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.page_table_oracle import update_rows_reference
from tokenspeed_jax.page_table import apply_holes, update_rows


def oracle(table, *args, **kw):
    """The shared numpy oracle on a copy: (updated table, rows whose writes were clamped)."""
    table = np.array(table, np.int32, copy=True)
    return table, update_rows_reference(table, *args, **kw)


def run(table, req_slots, begins, sizes, new_pages, full_refresh, rows, row_lens, **kw):
    """update_rows on device, checked against the numpy oracle on every call."""
    args = (req_slots, begins, sizes, new_pages, full_refresh, rows, row_lens)
    want, _ = oracle(table, *args, **{k: np.asarray(v) for k, v in kw.items()})
    out = update_rows(
        jnp.asarray(table, jnp.int32),
        jnp.asarray(req_slots, jnp.int32),
        jnp.asarray(begins, jnp.int32),
        jnp.asarray(sizes, jnp.int32),
        jnp.asarray(new_pages, jnp.int32),
        jnp.asarray(full_refresh, bool),
        jnp.asarray(rows, jnp.int32),
        jnp.asarray(row_lens, jnp.int32),
        **kw,
    )
    np.testing.assert_array_equal(out, want)
    return np.asarray(out)


def test_capacity_clamp_copies_2_0_3():
    width = 513
    table = np.zeros((3, width), np.int32)
    new = np.array([[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 7, 0]], np.int32)
    out = run(
        table,
        [0, 1, 2],
        [400, 513, 100],
        [2, 1, 3],
        new,
        [False] * 3,
        np.zeros((3, width), np.int32),
        [0, 0, 0],
    )
    assert list(out[0, 400:402]) == [1, 2] and out[0].sum() == 3
    assert out[1].sum() == 0  # begin == width: copies 0
    assert list(out[2, 100:103]) == [5, 6, 7] and out[2].sum() == 18
    copies = [np.count_nonzero(out[i]) for i in range(3)]
    assert copies == [2, 0, 3]
    assert oracle(
        table,
        [0, 1, 2],
        [400, 513, 100],
        [2, 1, 3],
        new,
        [False] * 3,
        np.zeros((3, width), np.int32),
        [0, 0, 0],
    )[1] == [1]


def test_clamp_begin_512_size_4():
    out = run(
        np.zeros((1, 513), np.int32),
        [0],
        [512],
        [4],
        [[700, 701, 702, 703]],
        [False],
        np.zeros((1, 513), np.int32),
        [0],
    )
    assert out[0, 512] == 700 and np.count_nonzero(out) == 1
    assert oracle(
        np.zeros((1, 513)), [0], [512], [4], [[700, 701, 702, 703]], [False], np.zeros((1, 513)), [0]
    )[1] == [0]


def test_full_refresh_alias_regression_99_11_10():
    # A held [P0=10, P1=11]; adopts CACHED=99 for page 0, P0=10 comes back as the tail.
    width = 513
    table = np.zeros((2, width), np.int32)
    table[1, :2] = [10, 11]
    rows = np.zeros((1, width), np.int32)
    rows[0, :3] = [99, 11, 10]
    args = (table, [1], [2], [1], [[10]], [True], rows, [3])
    out = run(*args)
    assert list(out[1, :4]) == [99, 11, 10, 0]
    assert np.count_nonzero(out[0]) == 0
    # The tail-only mirror reproduces the bug: logical pages 0 and 2 alias page 10.
    bug = run(*args, honor_full_refresh=False)
    assert list(bug[1, :3]) == [10, 11, 10]


def test_full_refresh_clamped_to_width_4():
    rows = np.array([[10, 11, 12, 13, 14, 15]], np.int32)
    table = np.full((1, 4), 7, np.int32)
    out = run(table, [0], [0], [0], np.zeros((1, 2), np.int32), [True], rows, [6])
    assert list(out[0]) == [10, 11, 12, 13]
    assert oracle(table, [0], [0], [0], np.zeros((1, 2)), [True], rows, [6])[1] == [0]


def test_full_refresh_with_size_0_still_writes_and_resets_stale_columns():
    table = np.full((1, 6), 9, np.int32)
    rows = np.zeros((1, 6), np.int32)
    rows[0, :3] = [10, 11, 12]
    out = run(table, [0], [0], [0], np.zeros((1, 2), np.int32), [True], rows, [3])
    assert list(out[0]) == [10, 11, 12, 0, 0, 0]


def test_size_0_and_padding_change_nothing():
    table = np.arange(12, dtype=np.int32).reshape(3, 4)
    out = run(
        table,
        [0, -1, 2],
        [1, 0, 0],
        [0, 3, 0],
        np.full((3, 3), 77, np.int32),
        [False, True, False],
        np.full((3, 4), 55, np.int32),
        [0, 4, 0],
    )
    np.testing.assert_array_equal(out, table)


def test_hole_slots():
    table = np.arange(1, 13, dtype=np.int32).reshape(2, 6)
    out = np.asarray(
        apply_holes(jnp.asarray(table), jnp.asarray([1, -1]), jnp.asarray([[0, 2, 6], [0, 1, 6]]))
    )
    expect = table.copy()
    expect[1, [0, 2]] = 0
    np.testing.assert_array_equal(out, expect)
    out2 = run(
        table,
        [1, -1],
        [0, 0],
        [0, 0],
        np.zeros((2, 1), np.int32),
        [False, False],
        np.zeros((2, 6), np.int32),
        [0, 0],
        hole_slots=jnp.asarray([[0, 2, 6], [0, 1, 6]]),
    )
    np.testing.assert_array_equal(out2, expect)


S, W, B, N, W2, M = 5, 9, 4, 3, 9, 2


@st.composite
def ops(draw):
    table = np.array(draw(st.lists(st.integers(0, 50), min_size=S * W, max_size=S * W)), np.int32).reshape(
        S, W
    )
    slots = draw(st.lists(st.integers(0, S - 1), min_size=B, max_size=B, unique=True))
    slots = np.array([s if draw(st.booleans()) or i == 0 else -1 for i, s in enumerate(slots)], np.int32)
    begins = np.array(draw(st.lists(st.integers(0, W + 2), min_size=B, max_size=B)), np.int32)
    sizes = np.array(draw(st.lists(st.integers(0, N + 1), min_size=B, max_size=B)), np.int32)
    new = np.array(draw(st.lists(st.integers(1, 99), min_size=B * N, max_size=B * N)), np.int32).reshape(B, N)
    refresh = np.array(draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    rows = np.array(draw(st.lists(st.integers(0, 99), min_size=B * W2, max_size=B * W2)), np.int32).reshape(
        B, W2
    )
    row_lens = np.array(draw(st.lists(st.integers(0, W2), min_size=B, max_size=B)), np.int32)
    holes = np.array(draw(st.lists(st.integers(0, W + 1), min_size=B * M, max_size=B * M)), np.int32).reshape(
        B, M
    )
    return table, slots, begins, sizes, new, refresh, rows, row_lens, holes


@settings(max_examples=150, deadline=None)
@given(ops(), st.booleans())
def test_random_ops_match_numpy_oracle(case, honor):
    table, slots, begins, sizes, new, refresh, rows, row_lens, holes = case
    got = run(
        table,
        slots,
        begins,
        sizes,
        new,
        refresh,
        rows,
        row_lens,
        honor_full_refresh=honor,
        hole_slots=jnp.asarray(holes),
    )
    want, _ = oracle(table, slots, begins, sizes, new, refresh, rows, row_lens, honor, holes)
    np.testing.assert_array_equal(got, want)


def test_one_compile_per_shape():
    traces = []

    @jax.jit
    def step(table, slots, begins, sizes, new, refresh, rows, row_lens):
        traces.append(1)  # runs once per trace, i.e. per compile
        return update_rows(table, slots, begins, sizes, new, refresh, rows, row_lens)

    rng = np.random.default_rng(0)
    table = jnp.zeros((8, 16), jnp.int32)
    for _ in range(6):
        table = step(
            table,
            jnp.asarray(rng.permutation(8)[:4] - rng.integers(0, 2, 4) * 9),
            jnp.asarray(rng.integers(0, 16, 4)),
            jnp.asarray(rng.integers(0, 4, 4)),
            jnp.asarray(rng.integers(1, 50, (4, 3))),
            jnp.asarray(rng.random(4) < 0.5),
            jnp.asarray(rng.integers(0, 50, (4, 16))),
            jnp.asarray(rng.integers(0, 16, 4)),
        )
    assert len(traces) == 1
    # The public function itself is jitted: its cache holds one entry per (shape, static) key.
    before = update_rows._cache_size()
    for _ in range(3):
        run(
            np.zeros((2, 7), np.int32),
            [0, 1],
            [1, 2],
            [1, 1],
            [[3], [4]],
            [False, True],
            np.ones((2, 7), np.int32),
            [2, 3],
        )
    assert update_rows._cache_size() == before + 1
