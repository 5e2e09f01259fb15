"""The bounds-checked interpret mode itself, and the surplus-grid-block regression it found.

`paged_attention`'s grid has `cdiv(T, block_q) + S` query blocks (a static upper bound). Blocks past
the last real one used to keep a key range ending past the request's kv_len, so they looped over
page-table columns past the row (for the last request: past the end of the table buffer) and used
the garbage as K/V addresses. Interpret mode clamps such reads and the masks hid the values, so
only the bounds check sees it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import PagedAttentionConfig, backend, paged_attention, paged_attention_reference
from pallas_kernels.bounds_check import BoundsViolation, check_bounds


def _gather_kernel(idx_ref, x_ref, o_ref):
    i = pl.program_id(0) * 8 + jax.lax.iota(jnp.int32, 8)
    j = backend.load(idx_ref, (i,))
    ok = j >= 0  # negative = masked lane
    o_ref_idx = (i,)
    backend.store(o_ref, o_ref_idx, backend.load(x_ref, (j,), mask=ok, other=0.0))


def _gather(idx: jax.Array, x: jax.Array) -> jax.Array:
    call = backend.pallas_call(
        _gather_kernel,
        out_shape=jax.ShapeDtypeStruct(idx.shape, x.dtype),
        grid=(idx.shape[0] // 8,),
        num_warps=1,
        num_stages=1,
        interpret=True,
        name="gather",
    )
    return call(idx, x)


def test_checker_reports_program_id_and_index() -> None:
    x = jnp.arange(10, dtype=jnp.float32)
    idx = jnp.array([0, 1, 2, 3, 4, 5, 6, 7, 9, 8, -1, -5, 3, 12, 2, 1], jnp.int32)
    want = r"load of ref\[10\] at program_id=\[1\]: index \[12\] out of range \(1 lane"
    with pytest.raises(BoundsViolation, match=want), check_bounds():
        _gather(idx, x)
    # Masked-off lanes (negative) may point anywhere. (Without the check, interpret mode clamps
    # the index-12 read above to x[9] and passes silently.)
    with check_bounds() as violations:
        got = _gather(idx.at[13].set(-1), x)
    assert violations == []
    np.testing.assert_array_equal(np.asarray(got)[:10], [0, 1, 2, 3, 4, 5, 6, 7, 9, 8])


def _shift_kernel(x_ref, o_ref):
    i = pl.program_id(0) * 8 + jax.lax.iota(jnp.int32, 8)
    backend.store(o_ref, (i + 1,), backend.load(x_ref, (i,)), mask=i < 15)


def test_checker_reports_stores() -> None:
    """A store under a true mask past the end (lane 15 -> index 16 is masked: fine; make the mask
    one lane too wide and it is reported)."""
    x = jnp.arange(16, dtype=jnp.float32)

    def run(kernel):
        return backend.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((16,), x.dtype),
            grid=(2,),
            num_warps=1,
            num_stages=1,
            interpret=True,
            name="shift",
        )(x)

    with check_bounds():
        np.testing.assert_array_equal(np.asarray(run(_shift_kernel))[1:], np.arange(15))

    def too_wide(x_ref, o_ref):
        i = pl.program_id(0) * 8 + jax.lax.iota(jnp.int32, 8)
        backend.store(o_ref, (i + 1,), backend.load(x_ref, (i,)), mask=i < 16)

    with (
        pytest.raises(
            BoundsViolation,
            match=r"store of ref\[16\] at program_id=\[1\]: "
            r"index \[16\]",
        ),
        check_bounds(),
    ):
        run(too_wide)


def _full_decode_batch(batch: int, ctx: int, page_size: int, hkv: int = 2, group: int = 4, d: int = 64):
    """Every row real (no padding row) and every row's kv_len == the table width in tokens: the
    shape of benchmarks/kernels.py's decode batch, where surplus blocks overrun the table."""
    rng = np.random.default_rng(0)
    pages = ctx // page_size
    num_pages = batch * pages + 1
    k = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    v = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    k[0] = v[0] = np.nan  # the null page
    table = (1 + rng.permutation(batch * pages)).reshape(batch, pages).astype(np.int32)
    q = rng.standard_normal((batch, hkv * group, d)).astype(np.float32)
    args = (
        q,
        k,
        v,
        table,
        np.full(batch, ctx, np.int32),
        np.arange(batch + 1, dtype=np.int32),
        np.array([batch], np.int32),
    )
    return tuple(jnp.asarray(a) for a in args)


@pytest.mark.parametrize("splits", [1, 2])
def test_surplus_blocks_stay_in_bounds(splits: int) -> None:
    """Regression: decode batch, all rows full -> grid has `batch` real + `batch` surplus blocks."""
    args = _full_decode_batch(batch=4, ctx=64, page_size=8)
    cfg = PagedAttentionConfig(pages_per_block=2, block_q=4, kv_splits=splits)
    with check_bounds():
        got = paged_attention(*args, interpret=True, config=cfg)
    want = paged_attention_reference(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 4, 20])
def test_surplus_blocks_with_window_and_prefill(window: int | None) -> None:
    """Mixed shapes under the check: a 4-token chunk plus decodes, and 93 padding tokens, so
    surplus blocks sit at token indices far past every row (a window must not turn them into a
    key range past the table either)."""
    args = list(_full_decode_batch(batch=4, ctx=64, page_size=16))
    q = jnp.concatenate([args[0], args[0][:3], jnp.zeros((93, *args[0].shape[1:]))])
    cu = jnp.array([0, 1, 2, 3, 7], jnp.int32)
    run = functools.partial(paged_attention, q, *args[1:5], cu, args[6], sliding_window=window)
    with check_bounds():
        got = run(interpret=True, config=PagedAttentionConfig(pages_per_block=1, block_q=4))
    want = paged_attention_reference(q, *args[1:5], cu, args[6], sliding_window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
