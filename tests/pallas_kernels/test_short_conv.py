"""short_conv: one test body for the jnp reference and the Pallas kernel (interpret mode) against a
float64 numpy oracle. Every pool position except the K-1 just before each request's chunk is NaN
(holes, older real slots, unused pages, positions >= kv_len), so reading anything else fails."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ShortConvConfig, gpu_compile, short_conv, short_conv_reference


def _kv_bucketed(x, conv_pages, page_table, kv_lens, cu, num_seqs, *args, **kw):
    """The runtime's reference backend: the page table cut to the smallest power of two of pages
    covering the longest live row (its kv bucket); malformed inputs go through unchanged."""
    if page_table.ndim == 2 and conv_pages.ndim == 3:
        n = int(np.asarray(num_seqs).reshape(-1)[0])
        need = -(-int(np.max(np.asarray(kv_lens)[:n], initial=1)) // conv_pages.shape[1])
        page_table = page_table[:, : min(page_table.shape[1], 1 << max(0, need - 1).bit_length())]
    return short_conv_reference(x, conv_pages, page_table, kv_lens, cu, num_seqs, *args, **kw)


IMPLS = {
    "reference": short_conv_reference,
    "reference_kv": _kv_bucketed,
    "pallas": functools.partial(short_conv, interpret=True),
}
if jax.default_backend() == "gpu":
    # GPU runs are extra: the same bodies check the compiled (Triton) kernel, not the interpreter
    IMPLS["pallas_gpu"] = short_conv


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_size: int = 8
    channels: int = 40
    taps: int = 3
    bias: bool = True
    dtype: str = "float32"
    seed: int = 0


CASES = {
    "decode_ps8_k3": Case((1, 1, 1), (17, 2, 9)),
    "prefill_fresh_ps16_k4": Case((5, 20), (5, 20), page_size=16, taps=4),
    "mixed_continuation_ps32_k2": Case((1, 7, 1, 3), (70, 40, 33, 3), page_size=32, taps=2),
    "chunk_straddles_page_k4_c160": Case((6, 1), (14, 8), page_size=8, taps=4, channels=160),
    "many_tokens_no_bias": Case((19, 1), (30, 5), bias=False, channels=24),
    "bf16": Case((1, 4, 1), (12, 9, 1), dtype="bfloat16"),
    "k1_no_history": Case((2, 1), (9, 4), taps=1),
}


def build(case: Case):
    rng = np.random.default_rng(case.seed)
    n, ps, c, k = len(case.q_lens), case.page_size, case.channels, case.taps
    max_pages = max(-(-kv // ps) for kv in case.kv_lens) + 1
    s = n + 1
    num_pages = sum(-(-kv // ps) for kv in case.kv_lens) + 4
    pool = rng.standard_normal((num_pages, ps, c))
    readable = np.zeros((num_pages, ps), bool)
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((s, max_pages), np.int32)
    for r, (ql, kv) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        start = kv - ql
        lo = max(0, start - (k - 1))  # the only pool positions a correct kernel reads
        for slot in range(max_pages):
            if slot * ps >= kv:
                page_table[r, slot] = int(rng.integers(0, num_pages))
            elif (slot + 1) * ps <= lo and rng.random() < 0.7:
                page_table[r, slot] = 0  # live-tail hole (some old slots stay real, still NaN)
            else:
                page = int(free.pop())
                page_table[r, slot] = page
                for off in range(ps):
                    readable[page, off] = lo <= slot * ps + off < start
    page_table[n] = rng.integers(0, num_pages, max_pages)
    pool[~readable] = np.nan
    t = sum(case.q_lens) + 2
    x = rng.standard_normal((t, c))
    w = rng.standard_normal((k, c))
    b = rng.standard_normal(c) if case.bias else None
    cu = np.zeros(s + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(case.q_lens)
    cu[n + 1 :] = cu[n]
    kv_lens = np.array([*case.kv_lens, 12345], np.int32)
    dt = jnp.bfloat16 if case.dtype == "bfloat16" else jnp.float32
    x, pool, w = (np.asarray(jnp.asarray(a, dt)) for a in (x, pool, w))
    b = None if b is None else np.asarray(jnp.asarray(b, dt))
    return (x, pool, page_table, kv_lens, cu, np.array([n], np.int32), w, b)


def oracle(x, pool, page_table, kv_lens, cu, num_seqs, w, b):
    x, pool, w = (np.asarray(a, np.float32).astype(np.float64) for a in (x, pool, w))
    k, ps = w.shape[0], pool.shape[1]
    y = np.zeros(x.shape)
    for s in range(int(num_seqs[0])):
        ql, kv = cu[s + 1] - cu[s], kv_lens[s]
        for i in range(ql):
            pos, acc = kv - ql + i, np.zeros(x.shape[1])
            for j in range(k):
                p = pos - (k - 1) + j
                if p >= kv - ql:
                    acc += w[j] * x[cu[s] + p - (kv - ql)]
                elif p >= 0:
                    acc += w[j] * pool[page_table[s, p // ps], p % ps]
            y[cu[s] + i] = acc + (0 if b is None else np.asarray(b, np.float32))
    return y


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_oracle(name: str, impl: str) -> None:
    case = CASES[name]
    args = build(case)
    want = oracle(*args)
    jargs = [None if a is None else jnp.asarray(a) for a in args]
    got = np.asarray(IMPLS[impl](*jargs).astype(jnp.float32)).astype(np.float64)
    assert np.isfinite(got).all()
    assert np.all(got[sum(case.q_lens) :] == 0.0), "padding tokens must be zeros"
    tol = 3e-2 if case.dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_small_tiles_match() -> None:
    args = build(CASES["chunk_straddles_page_k4_c160"])
    jargs = [jnp.asarray(a) for a in args]
    got = short_conv(*jargs, interpret=True, config=ShortConvConfig(block_t=2, block_c=32))
    np.testing.assert_allclose(np.asarray(got), oracle(*args), atol=1e-5, rtol=1e-5)


BAD = {
    "x_rank": lambda a: (a[0][0], *a[1:]),
    "pool_channels": lambda a: (a[0], a[1][..., :5], *a[2:]),
    "weight_channels": lambda a: (*a[:6], a[6][:, :5], a[7]),
    "weight_rank": lambda a: (*a[:6], a[6][0], a[7]),
    "bias_shape": lambda a: (*a[:7], a[7][:3]),
    "page_table_float": lambda a: (a[0], a[1], a[2].astype(jnp.float32), *a[3:]),
    "cu_len": lambda a: (*a[:4], a[4][:-1], *a[5:]),
    "num_seqs_shape": lambda a: (*a[:5], jnp.array(1, jnp.int32), *a[6:]),
}


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("bad", sorted(BAD))
def test_invalid_inputs_raise(impl: str, bad: str) -> None:
    args = [jnp.asarray(a) for a in build(CASES["decode_ps8_k3"])]
    with pytest.raises(ValueError, match="="):
        IMPLS[impl](*BAD[bad](args))


@pytest.mark.parametrize("kwargs", [dict(block_t=3), dict(block_c=0), dict(num_warps=5)])
def test_invalid_config_raises(kwargs) -> None:
    with pytest.raises(ValueError, match="ShortConvConfig"):
        ShortConvConfig(**kwargs)


@pytest.mark.skipif(
    gpu_compile.needs_plugin_to_lower() and gpu_compile.missing() is not None,
    reason="this jaxlib compiles Triton while lowering: needs the gpu-compile extra",
)
def test_lowers_to_triton() -> None:
    spec = jax.ShapeDtypeStruct
    t, c, p, ps, s, mp = 256, 1024, 512, 16, 64, 64
    shapes = (
        spec((t, c), jnp.bfloat16),
        spec((p, ps, c), jnp.bfloat16),
        spec((s, mp), jnp.int32),
        spec((s,), jnp.int32),
        spec((s + 1,), jnp.int32),
        spec((1,), jnp.int32),
        spec((3, c), jnp.bfloat16),
        spec((c,), jnp.bfloat16),
    )
    text = gpu_compile.lower_for_cuda(short_conv, *shapes).as_text()
    # jaxlib <= 0.10.2: a Triton IR custom call; later: the compiled kernel's FFI call
    assert ("xla.gpu.triton" in text or "triton_kernel_call" in text) and "short_conv_k3" in text
