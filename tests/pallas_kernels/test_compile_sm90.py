"""Compile every kernel variant for the H200 (sm_90a) on this CPU machine: lowering -> XLA's
Triton pipeline -> PTX -> `ptxas -v`, then check what would fail or be slow on the GPU (shared
memory over 227 KiB, register spills in bf16 decode, a single-buffered decode K/V loop).
Needs the `gpu-compile` extra (jax-cuda12-plugin + nvidia-cuda-nvcc-cu12); skipped without it."""

from __future__ import annotations

import pytest

from pallas_kernels import gpu_compile

_MISSING = gpu_compile.missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"gpu-compile extra: {_MISSING}")

if _MISSING is None:
    from pallas_kernels import compile_check

    VARIANTS = {v.name: v for v in compile_check.variants(full=True)}
else:
    VARIANTS = {}


@pytest.mark.parametrize(
    "name", sorted(VARIANTS) or ["(gpu-compile extra missing)"], ids=lambda name: name.replace(" ", "_")
)
def test_variant_compiles_for_sm90a(name: str) -> None:
    reports = compile_check.compile_variant(VARIANTS[name])
    assert reports, f"{name}: no Pallas Triton kernel in the lowered module"
    for r in reports:
        assert r.registers > 0, r
        assert compile_check.problems(r) == [], r.row()


def test_default_decode_is_multibuffered_without_spills() -> None:
    """The shipped decode default (64 x 32k, bf16): 3 stages give cp.async.wait_group 2 (two K/V
    tiles in flight) at <= 227 KiB shared memory, no spills, >= 4 waves on 132 SMs."""
    [r] = compile_check.compile_variant(VARIANTS["decode B=64 ctx=32k page=16"])
    assert r.stages == 3 and r.max_wait_group >= 2, r.row()
    assert r.spill_bytes == 0 and r.smem_bytes <= compile_check.H200.smem_per_block, r.row()
    assert r.waves >= 4, r.row()


def test_checks_catch_a_single_buffered_loop() -> None:
    """The check can fail: the same kernel at num_stages=1 (no prefetch) is flagged."""
    from pallas_kernels import PagedAttentionConfig

    v = compile_check._attention(
        "stages=1",
        q_lens=64,
        seqs=64,
        ctx=8192,
        page_size=16,
        decode=True,
        config=PagedAttentionConfig(num_stages=1),
    )
    [r] = compile_check.compile_variant(v)
    assert any("single-buffered" in p for p in compile_check.problems(r)), r.row()
