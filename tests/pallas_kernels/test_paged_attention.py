"""paged_attention: one test body run against the jnp reference and the Pallas kernel (interpret
mode), both compared with an independent float64 numpy oracle. Every byte the kernels must not
depend on (null page, unused pages, slid-out slots, positions >= kv_len) is NaN."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    MixedConfig,
    PagedAttentionConfig,
    gpu_compile,
    paged_attention,
    paged_attention_reference,
)
from pallas_kernels.paged_attention_cpu import paged_attention_cpu


def _kv_bucketed(fn):
    """What the runtime's reference backend does: the page table cut to the smallest power of two
    of pages covering the longest live row (its kv bucket)."""

    def call(q, k, v, page_table, kv_lens, cu, num_seqs, **kw):
        if page_table.ndim == 2 and k.ndim == 4:  # malformed inputs go through unchanged
            n = int(np.asarray(num_seqs).reshape(-1)[0])
            need = -(-int(np.max(np.asarray(kv_lens)[:n], initial=1)) // k.shape[1])
            cols = min(page_table.shape[1], 1 << max(0, need - 1).bit_length())
            page_table = page_table[:, :cols]
        return fn(q, k, v, page_table, kv_lens, cu, num_seqs, **kw)

    return call


IMPLS = {
    "reference": paged_attention_reference,
    # the runtime's CPU backend: kv-bucketed tables; by default short requests token by token
    # (a page loop) and longer ones in blocks; or one block size for every request
    "reference_kv": _kv_bucketed(paged_attention_reference),
    "reference_kv_bq1": _kv_bucketed(functools.partial(paged_attention_reference, block_q=1)),
    "reference_kv_bq8": _kv_bucketed(functools.partial(paged_attention_reference, block_q=8)),
    "pallas": functools.partial(paged_attention, interpret=True),
    # the default CPU backend: decode tokens in the native kernel (the reference if no compiler)
    "cpu_kv": _kv_bucketed(paged_attention_cpu),
}
if jax.default_backend() == "gpu":
    # GPU runs are extra: the same bodies check the compiled (Triton) kernel, not the interpreter
    IMPLS["pallas_gpu"] = paged_attention


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_size: int = 16
    hkv: int = 2
    group: int = 2
    head_dim: int = 64
    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    sm_scale: float | None = None
    dtype: str = "float32"
    q_scale: float = 1.0  # larger values make soft cap / sinks actually matter
    seed: int = 0


CASES = {
    "decode_ps16_g4": Case((1, 1, 1), (37, 5, 64), page_size=16, group=4),
    "prefill_ps8_g1_d128": Case((13, 20), (13, 20), page_size=8, group=1, head_dim=128),
    "mixed_ps32_g2": Case((1, 9, 1, 4), (70, 9, 33, 40), page_size=32, group=2),
    "mixed_ps16_g8": Case((3, 1, 6), (3, 50, 30), page_size=16, hkv=1, group=8),
    "window_small_holes_ps8": Case((1, 6, 1, 17), (60, 45, 9, 40), page_size=8, window=10),
    "window_page_aligned_ps8": Case((1, 1, 8), (64, 33, 48), page_size=8, window=16, group=4),
    "window_larger_than_ctx": Case((1, 7, 1), (70, 7, 20), page_size=16, window=200),
    "soft_cap": Case((1, 5, 2), (30, 5, 19), soft_cap=5.0, q_scale=4.0),
    "sinks": Case((1, 4, 1), (25, 4, 2), sinks=True, group=4),
    # 19 short requests (two token-pass chunks of 16) beside a 37-token chunk (two blocks)
    "many_decodes_long_chunk": Case((1,) * 17 + (2, 37), tuple(range(5, 90, 5)) + (12, 60), page_size=8),
    "sm_scale": Case((2, 1), (9, 17), sm_scale=0.3, page_size=8),
    "all_f32_ps16_g4": Case(
        (1, 12, 1), (80, 12, 41), page_size=16, group=4, window=24, soft_cap=8.0, sinks=True, q_scale=3.0
    ),
    "bf16_mixed_d128": Case(
        (1, 10, 1),
        (40, 10, 17),
        page_size=16,
        head_dim=128,
        group=4,
        window=20,
        soft_cap=10.0,
        sinks=True,
        dtype="bfloat16",
    ),
    "bf16_prefill_g8": Case((24,), (24,), page_size=8, hkv=1, group=8, dtype="bfloat16"),
}


def build(case: Case):
    """Random inputs with NaN everywhere the result must not depend on, plus padding rows/tokens.

    Returns (args tuple of numpy arrays, kwargs, num_seqs)."""
    rng = np.random.default_rng(case.seed)
    n = len(case.q_lens)
    ps, hq = case.page_size, case.hkv * case.group
    max_pages = max(-(-kv // ps) for kv in case.kv_lens) + 2
    s = n + 1  # one padding row
    needed = sum(-(-kv // ps) for kv in case.kv_lens)
    num_pages = needed + 6  # null page + spare NaN pages
    shape = (num_pages, ps, case.hkv, case.head_dim)
    k = rng.standard_normal(shape)
    v = rng.standard_normal(shape)
    live = np.zeros((num_pages, ps), bool)  # positions a correct kernel may read
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((s, max_pages), np.int32)
    for r, (ql, kv) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        lo = 0 if case.window is None else max(0, kv - ql - case.window + 1)
        for slot in range(max_pages):
            if slot * ps >= kv:  # unused columns: garbage pointers to NaN pages
                page_table[r, slot] = int(rng.integers(0, num_pages))
            elif (slot + 1) * ps <= lo:  # fully slid out for every query: a hole
                page_table[r, slot] = 0
            else:
                page = int(free.pop())
                page_table[r, slot] = page
                for off in range(ps):
                    live[page, off] = lo <= slot * ps + off < kv
    page_table[n] = rng.integers(0, num_pages, max_pages)  # padding row: garbage
    k[~live] = np.nan
    v[~live] = np.nan
    t = sum(case.q_lens) + 3  # three padding tokens
    q = rng.standard_normal((t, hq, case.head_dim)) * case.q_scale
    cu = np.zeros(s + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(case.q_lens)
    cu[n + 1 :] = cu[n]
    kv_lens = np.array([*case.kv_lens, 10**6], np.int32)  # padding row: garbage length
    dtype = jnp.bfloat16 if case.dtype == "bfloat16" else jnp.float32
    # Round through the kernel dtype so the oracle sees exactly the values the kernel sees.
    q, k, v = (np.asarray(jnp.asarray(a, dtype)) for a in (q, k, v))
    kwargs = dict(
        sm_scale=case.sm_scale,
        sliding_window=case.window,
        soft_cap=case.soft_cap,
        sinks=rng.standard_normal(hq).astype(np.float32) * 2 if case.sinks else None,
    )
    args = (q, k, v, page_table, kv_lens, cu, np.array([n], np.int32))
    return args, kwargs


def oracle(q, k, v, page_table, kv_lens, cu, num_seqs, *, sm_scale, sliding_window, soft_cap, sinks):
    """Per token, per head, float64 numpy: gather the visible keys, softmax (+ sink), sum."""
    q, k, v = (np.asarray(a, np.float32).astype(np.float64) for a in (q, k, v))
    t, hq, d = q.shape
    ps, hkv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((t, hq, d))
    for s in range(int(num_seqs[0])):
        ql, kv = cu[s + 1] - cu[s], kv_lens[s]
        for i in range(ql):
            pos = kv - ql + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            positions = np.arange(lo, pos + 1)
            pages = page_table[s, positions // ps]
            keys, vals = k[pages, positions % ps], v[pages, positions % ps]  # [L, Hkv, D]
            for h in range(hq):
                logits = keys[:, h // (hq // hkv)] @ q[cu[s] + i, h] * scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                if sinks is not None:
                    logits = np.append(logits, sinks[h])
                w = np.exp(logits - logits.max())
                w /= w.sum()
                out[cu[s] + i, h] = w[: len(positions)] @ vals[:, h // (hq // hkv)]
    return out


def check_matches_oracle(case: Case, impl: Callable[..., jax.Array]) -> None:
    """The shared test body: `impl` (paged_attention's signature) on `case`'s inputs, with NaN
    wherever the result must not depend, == the float64 oracle; padding tokens exact zeros."""
    args, kwargs = build(case)
    want = oracle(*args, **kwargs)
    jargs = [jnp.asarray(a) for a in args]
    jkw = {key: (jnp.asarray(val) if isinstance(val, np.ndarray) else val) for key, val in kwargs.items()}
    got = np.asarray(impl(*jargs, **jkw).astype(jnp.float32)).astype(np.float64)
    assert got.shape == want.shape
    assert np.isfinite(got).all(), "NaN/inf leaked from pages the kernel must not depend on"
    n_real = int(args[5][len(case.q_lens)])
    assert np.all(got[n_real:] == 0.0), "padding tokens must be zeros"
    tol = 3e-2 if case.dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_oracle(name: str, impl: str) -> None:
    check_matches_oracle(CASES[name], IMPLS[impl])


def _interpreted(config: PagedAttentionConfig | MixedConfig) -> Callable[..., jax.Array]:
    return functools.partial(paged_attention, interpret=True, config=config)


def test_many_pages_per_block_and_block_q() -> None:
    """Non-default tiling (1 page per tile, 16 query tokens per program) gives the same answer."""
    cfg = PagedAttentionConfig(pages_per_block=2, block_q=16, num_warps=8, num_stages=3)
    check_matches_oracle(CASES["window_small_holes_ps8"], _interpreted(cfg))


@pytest.mark.parametrize(
    ("name", "splits"),
    [("all_f32_ps16_g4", 4), ("window_small_holes_ps8", 2), ("bf16_mixed_d128", 2), ("mixed_ps16_g8", 8)],
)
def test_kv_splits_match_oracle(name: str, splits: int) -> None:
    """Flash-decoding path (partials merged in jnp, sinks merged once) == oracle; more splits
    than tiles leaves empty splits that must not disturb the merge."""
    case = CASES[name]
    cfg = PagedAttentionConfig(
        pages_per_block=32 // case.page_size or 1, block_q=max(1, 16 // case.group), kv_splits=splits
    )
    check_matches_oracle(case, _interpreted(cfg))


@pytest.mark.parametrize("decode_splits", [1, 2])
@pytest.mark.parametrize(
    "name", ["all_f32_ps16_g4", "many_decodes_long_chunk", "bf16_mixed_d128", "mixed_ps16_g8"]
)
def test_mixed_two_launches_match_oracle(name: str, decode_splits: int) -> None:
    """MixedConfig: the decode launch (with or without kv splits, sinks merged outside) writes
    only its requests' rows, the prefill launch the rest, into one aliased output."""
    case = CASES[name]
    ppb = 32 // case.page_size or 1
    cfg = MixedConfig(
        decode=PagedAttentionConfig(
            pages_per_block=ppb, block_q=max(1, 16 // case.group), kv_splits=decode_splits
        ),
        prefill=PagedAttentionConfig(pages_per_block=ppb, block_q=max(1, 64 // case.group), num_warps=8),
    )
    check_matches_oracle(case, _interpreted(cfg))


def test_mixed_config_only_for_prefill_shaped_batches() -> None:
    from pallas_kernels import mixed_config

    both = mixed_config(2108, 64, 16, 4, 8, 512)  # 60 decodes + 4 x 512-token chunks
    assert both is not None
    assert (both.decode.block_q, both.decode.kv_splits) == (4, 1)  # 16 rows, no T-sized partials
    assert (both.prefill.block_q, both.prefill.kv_splits) == (16, 1)  # 64 rows
    assert mixed_config(64, 64, 16, 4, 8, 512) is None  # decode-dominated: one launch
    assert mixed_config(512, 1, 16, 4, 8, 512) is None  # one request: one launch


def test_default_config_splits_long_decode_only() -> None:
    from pallas_kernels import default_config

    # 64 requests x 8 kv heads = 512 programs: 4 splits = 2048 >= 4 waves x 3/SM x 132 SMs
    assert default_config(64, 64, 16, 4, 8, 2048).kv_splits == 4
    assert default_config(64, 64, 16, 4, 8, 2048).num_stages == 3  # decode: 2 tiles in flight
    assert default_config(8, 8, 16, 4, 8, 2048).kv_splits == 32
    assert default_config(8, 8, 16, 4, 8, 128).kv_splits == 8  # 32 tiles: >= 4 per split
    assert default_config(8, 8, 16, 4, 8, 8).kv_splits == 1  # short context: nothing to split
    assert default_config(2048, 64, 16, 4, 8, 2048).kv_splits == 1  # prefill-shaped


def _valid_args():
    args, _ = build(Case((1, 2), (5, 2), page_size=8))
    return [jnp.asarray(a) for a in args]


BAD = {
    "q_rank": lambda a: (a[0][0], *a[1:]),
    "kv_shape_mismatch": lambda a: (a[0], a[1], a[2][:, :, :1], *a[3:]),
    "head_dim": lambda a: (a[0][..., :32], *a[1:]),
    "gqa_ratio": lambda a: (a[0][:, :3], *a[1:]),
    "dtype_mix": lambda a: (a[0].astype(jnp.bfloat16), *a[1:]),
    "int_q": lambda a: (a[0].astype(jnp.int32), *a[1:]),
    "page_table_rank": lambda a: (*a[:3], a[3][0], *a[4:]),
    "page_table_float": lambda a: (*a[:3], a[3].astype(jnp.float32), *a[4:]),
    "kv_lens_len": lambda a: (*a[:4], a[4][:1], *a[5:]),
    "cu_len": lambda a: (*a[:5], a[5][:-1], a[6]),
    "num_seqs_shape": lambda a: (*a[:6], jnp.array(2, jnp.int32)),
}
BAD_KW = {
    "window_zero": dict(sliding_window=0),
    "window_float": dict(sliding_window=2.5),
    "soft_cap_neg": dict(soft_cap=-1.0),
    "scale_zero": dict(sm_scale=0.0),
    "sinks_shape": dict(sinks=jnp.zeros((3,), jnp.float32)),
}


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("bad", sorted(BAD) + sorted(BAD_KW))
def test_invalid_inputs_raise(impl: str, bad: str) -> None:
    args = _valid_args()
    kwargs = {}
    if bad in BAD:
        args = BAD[bad](args)
    else:
        kwargs = BAD_KW[bad]
    with pytest.raises(ValueError, match=r"=|must"):
        IMPLS[impl](*args, **kwargs)


@pytest.mark.parametrize(
    "kwargs", [dict(block_q=3), dict(pages_per_block=0), dict(num_warps=6), dict(num_stages=0)]
)
def test_invalid_config_raises(kwargs) -> None:
    with pytest.raises(ValueError, match="PagedAttentionConfig"):
        PagedAttentionConfig(**kwargs)


def test_config_incompatible_with_shapes_raises() -> None:
    args = _valid_args()  # group 2, page 8
    with pytest.raises(ValueError, match="rows"):
        paged_attention(*args, interpret=True, config=PagedAttentionConfig(block_q=4))
    with pytest.raises(ValueError, match="tokens"):
        paged_attention(*args, interpret=True, config=PagedAttentionConfig(pages_per_block=1, block_q=8))
    q, k, v, *rest = args
    k12 = jnp.zeros((4, 12, *k.shape[2:]), k.dtype)
    with pytest.raises(ValueError, match="page_size"):
        paged_attention(q, k12, k12, *rest, interpret=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tokens", [64, 1024])  # decode-shaped and prefill-shaped defaults
@pytest.mark.skipif(
    gpu_compile.needs_plugin_to_lower() and gpu_compile.missing() is not None,
    reason="this jaxlib compiles Triton while lowering: needs the gpu-compile extra",
)
def test_lowers_to_triton(dtype: str, tokens: int) -> None:
    """Cross-lower for CUDA on this CPU machine: catches Triton-lowering errors (unsupported ops,
    non-power-of-two tiles) without a GPU. Does not run Triton's own compiler passes."""
    dt = jnp.dtype(dtype)
    t, hq, d, p, ps, hkv, s, mp = tokens, 32, 128, 256, 16, 8, 64, 128
    spec = jax.ShapeDtypeStruct
    shapes = (
        spec((t, hq, d), dt),
        spec((p, ps, hkv, d), dt),
        spec((p, ps, hkv, d), dt),
        spec((s, mp), jnp.int32),
        spec((s,), jnp.int32),
        spec((s + 1,), jnp.int32),
        spec((1,), jnp.int32),
    )
    fn = jax.jit(
        lambda *a: paged_attention(
            *a, sliding_window=4096, soft_cap=30.0, sinks=jnp.zeros((hq,), jnp.float32)
        )
    )
    text = gpu_compile.lower_for_cuda(fn, *shapes).as_text()
    # jaxlib <= 0.10.2: a Triton IR custom call; later: the compiled kernel's FFI call
    assert "xla.gpu.triton" in text or "triton_kernel_call" in text
    assert "ragged_paged_attention" in text


@pytest.mark.parametrize("name", ["mixed_ps32_g2", "window_small_holes_ps8", "sinks"])
@pytest.mark.parametrize("block_q", [1, 4])
def test_reference_in_block_batches(name: str, block_q: int) -> None:
    """The reference's lax.map path (block batches smaller than the step, the last one padded
    with empty blocks) == the float64 oracle."""
    case = CASES[name]
    args, kwargs = build(case)
    jargs = [jnp.asarray(a) for a in args]
    jkw = {key: (jnp.asarray(val) if isinstance(val, np.ndarray) else val) for key, val in kwargs.items()}
    got = paged_attention_reference(*jargs, **jkw, block_q=block_q, max_gather_elems=1)
    np.testing.assert_allclose(np.asarray(got), oracle(*args, **kwargs), atol=2e-5, rtol=2e-5)
