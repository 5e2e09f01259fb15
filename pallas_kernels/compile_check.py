"""Compile every kernel variant for the H200 (sm_90a) without a GPU and check the machine code.

For each variant (kernel + realistic static shapes + options): lower for CUDA, run XLA's Triton
pipeline to PTX, assemble with `ptxas -v` (see `gpu_compile`), and report grid, warps, stages,
registers, spills, shared memory, the deepest `cp.async.wait_group` (how many K/V tiles are in
flight while one is consumed: 0 = single-buffered) and occupancy. `problems()` lists what would
fail or be slow on the GPU. Used by `tests/pallas_kernels/test_compile_sm90.py` (CI) and
`benchmarks/kernel_compile.py` (the full table).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels import gpu_compile, kv_quant
from pallas_kernels.gated_delta_pallas import GatedDeltaPallasConfig, gated_delta_chunk
from pallas_kernels.mamba2_ssd_pallas import SsdPallasConfig, ssd_chunk
from pallas_kernels.paged_attention import DECODE_TUNING_CANDIDATES, PagedAttentionConfig, paged_attention
from pallas_kernels.short_conv import short_conv

__all__ = ["H200", "Report", "Variant", "compile_variant", "problems", "variants"]

_S = jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str = "H200"
    sms: int = 132
    regs_per_sm: int = 65536
    smem_per_sm: int = 233472  # 228 KiB, of which each block may use at most 227 KiB
    smem_per_block: int = 232448
    smem_reserved_per_block: int = 1024
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    hbm_bytes_per_s: float = 4.3e12  # sustained-read ceiling used by the roofline model

    def blocks_per_sm(self, registers: int, warps: int, smem: int) -> int:
        """Resident programs per SM, limited by registers (allocated per warp in 256-register
        units), shared memory, warps and the block limit."""
        regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
        by_regs = self.regs_per_sm // (regs_per_warp * warps)
        by_smem = self.smem_per_sm // (smem + self.smem_reserved_per_block)
        return max(0, min(by_regs, by_smem, self.max_warps_per_sm // warps, self.max_blocks_per_sm))


H200 = Gpu()


@dataclasses.dataclass(frozen=True)
class Variant:
    """A kernel call at static shapes. `decode`: a bf16 decode variant of a shipped default
    config, which must not spill and must keep more than one K/V tile in flight (exploratory
    tuning variants are decode=False: only the hard limits apply to them)."""

    name: str
    fn: Callable[..., jax.Array]
    shapes: tuple[jax.ShapeDtypeStruct, ...]
    decode: bool = False
    real_programs: int | None = None  # programs with work (the grid also has surplus blocks)


@dataclasses.dataclass(frozen=True)
class Report:
    variant: str
    kernel: str
    grid: tuple[int, int, int]
    warps: int
    stages: int
    registers: int
    spill_bytes: int
    smem_bytes: int
    max_wait_group: int
    blocks_per_sm: int
    waves: float  # real programs / (blocks per SM x SMs)
    decode: bool

    def row(self) -> str:
        g = "x".join(str(x) for x in self.grid)
        return (
            f"| {self.variant} | {g} | {self.warps} | {self.stages} | {self.registers} | "
            f"{self.spill_bytes} | {self.smem_bytes / 1024:.1f} | {self.max_wait_group} | "
            f"{self.blocks_per_sm} | {self.waves:.1f} |"
        )


HEADER = (
    "| variant | grid | warps | stages | registers | spill bytes | smem KiB | "
    "cp.async.wait_group max | blocks/SM | waves (132 SMs) |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _attention(
    name: str,
    *,
    q_lens: int,
    seqs: int,
    ctx: int,
    page_size: int,
    hkv: int = 8,
    hq: int = 32,
    d: int = 128,
    dtype: DTypeLike = jnp.bfloat16,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: bool = False,
    config: PagedAttentionConfig | None = None,
    decode: bool = False,
    real_programs: int | None = None,
    kv_cache_dtype: str = "auto",
) -> Variant:
    """`q_lens` packed query tokens over `seqs` requests of up to `ctx` tokens; a pool holding
    every request's full context (so 32k x 64 requests is a > 4 GiB pool: 64-bit offsets).
    kv_cache_dtype int8 / fp8_e4m3: quantized pools plus their f16 scale pools."""
    max_pages = ctx // page_size
    pool = seqs * max_pages + 1
    values = kv_quant.quantized_dtype(kv_cache_dtype) or dtype
    scales = () if values == dtype else (_S((pool, page_size, hkv), kv_quant.SCALE_DTYPE),) * 2
    shapes = (
        _S((q_lens, hq, d), dtype),
        _S((pool, page_size, hkv, d), values),
        _S((pool, page_size, hkv, d), values),
        _S((seqs, max_pages), jnp.int32),
        _S((seqs,), jnp.int32),
        _S((seqs + 1,), jnp.int32),
        _S((1,), jnp.int32),
        *scales,
    )

    def fn(*args: jax.Array) -> jax.Array:
        quant = len(args) > 7
        return paged_attention(
            *args[:7],
            sinks=jnp.zeros((hq,), jnp.float32) if sinks else None,
            sliding_window=window,
            soft_cap=soft_cap,
            config=config,
            k_scales=args[7] if quant else None,
            v_scales=args[8] if quant else None,
        )

    return Variant(name, fn, shapes, decode=decode, real_programs=real_programs)


def _conv(
    name: str,
    *,
    tokens: int,
    seqs: int,
    channels: int,
    page_size: int,
    taps: int = 3,
    dtype: DTypeLike = jnp.bfloat16,
) -> Variant:
    pool = 4 * seqs + 1
    shapes = (
        _S((tokens, channels), dtype),
        _S((pool, page_size, channels), dtype),
        _S((seqs, 64), jnp.int32),
        _S((seqs,), jnp.int32),
        _S((seqs + 1,), jnp.int32),
        _S((1,), jnp.int32),
        _S((taps, channels), dtype),
        _S((channels,), dtype),
    )
    return Variant(name, short_conv, shapes)


def _gated_delta(
    name: str,
    *,
    heads: int = 32,
    chunk: int = 64,
    dk: int = 128,
    dv: int = 128,
    dtype: DTypeLike = jnp.bfloat16,
    config: GatedDeltaPallasConfig | None = None,
) -> Variant:
    """One chunk of the gated delta rule (Qwen3.5: 16..32 value heads, Dk = Dv = 128, C = 64)."""
    shapes = (
        _S((heads, dk, dv), jnp.float32),
        _S((chunk, heads, dk), dtype),
        _S((chunk, heads, dk), dtype),
        _S((chunk, heads, dv), dtype),
        _S((chunk, heads), dtype),
        _S((chunk, heads), dtype),
    )

    def fn(*args: jax.Array) -> jax.Array:
        o, _ = gated_delta_chunk(*args, config=config)
        return o

    return Variant(name, fn, shapes)


def _ssd(
    name: str,
    *,
    heads: int = 64,
    groups: int = 8,
    chunk: int = 64,
    p: int = 64,
    n: int = 128,
    dtype: DTypeLike = jnp.bfloat16,
    config: SsdPallasConfig | None = None,
) -> Variant:
    """One chunk of Mamba2's SSD (Bamba-9B / Nemotron-H: 64..128 heads of P = 64, N = 128)."""
    shapes = (
        _S((heads, p, n), jnp.float32),
        _S((chunk, heads, p), dtype),
        _S((chunk, heads), jnp.float32),
        _S((heads,), jnp.float32),
        _S((chunk, groups, n), dtype),
        _S((chunk, groups, n), dtype),
    )

    def fn(*args: jax.Array) -> jax.Array:
        y, _ = ssd_chunk(*args, config=config)
        return y

    return Variant(name, fn, shapes)


def variants(full: bool = True) -> list[Variant]:
    """The compile matrix. `full=False`: one variant per distinct kernel body (CI)."""
    b = 64
    out = []
    for ps in (16, 32):
        for ctx in (8192, 32768) if full else (32768,) if ps == 16 else (8192,):
            out.append(
                _attention(
                    f"decode B={b} ctx={ctx // 1024}k page={ps}",
                    q_lens=b,
                    seqs=b,
                    ctx=ctx,
                    page_size=ps,
                    decode=True,
                    real_programs=b * 8,
                )
            )
    out += [
        _attention(
            "decode B=64 ctx=8k page=64 (1 page per tile)",
            q_lens=b,
            seqs=b,
            ctx=8192,
            page_size=64,
            decode=True,
            real_programs=b * 8,
        ),
        _attention(
            "decode ctx=32k window=4096",
            q_lens=b,
            seqs=b,
            ctx=32768,
            page_size=16,
            window=4096,
            decode=True,
            real_programs=b * 8,
        ),
        _attention(
            "decode ctx=8k soft cap + sinks",
            q_lens=b,
            seqs=b,
            ctx=8192,
            page_size=16,
            soft_cap=30.0,
            sinks=True,
            decode=True,
            real_programs=b * 8,
        ),
        _attention(
            "decode B=8 ctx=32k (kv_splits)",
            q_lens=8,
            seqs=8,
            ctx=32768,
            page_size=16,
            decode=True,
            real_programs=8 * 8,
        ),
        _attention("prefill 4x512 ctx=4k", q_lens=2048, seqs=4, ctx=4096, page_size=16),
        _attention("mixed 4x512 prefill + 60 decodes", q_lens=4 * 512 + 60, seqs=64, ctx=8192, page_size=16),
        _attention(
            "decode B=64 ctx=32k page=16 int8 KV",
            q_lens=b,
            seqs=b,
            ctx=32768,
            page_size=16,
            decode=True,
            real_programs=b * 8,
            kv_cache_dtype="int8",
        ),
        _attention(
            "decode B=64 ctx=32k page=16 fp8 KV",
            q_lens=b,
            seqs=b,
            ctx=32768,
            page_size=16,
            decode=True,
            real_programs=b * 8,
            kv_cache_dtype="fp8_e4m3",
        ),
        _attention(
            "prefill 4x512 ctx=4k int8 KV", q_lens=2048, seqs=4, ctx=4096, page_size=16, kv_cache_dtype="int8"
        ),
        _conv("short_conv C=3072 decode B=64", tokens=64, seqs=64, channels=3072, page_size=16),
        _conv("short_conv C=3072 prefill 2048", tokens=2048, seqs=4, channels=3072, page_size=16),
        _attention(
            "tiny model decode (f32, d=16, window 16)",
            q_lens=16,
            seqs=16,
            ctx=512,
            page_size=16,
            hkv=2,
            hq=4,
            d=16,
            dtype=jnp.float32,
            window=16,
        ),
        _attention(
            "tiny model prefill (f32, d=16)",
            q_lens=512,
            seqs=16,
            ctx=512,
            page_size=16,
            hkv=2,
            hq=4,
            d=16,
            dtype=jnp.float32,
        ),
        _conv(
            "tiny model short_conv (f32, C=64)",
            tokens=512,
            seqs=16,
            channels=64,
            page_size=16,
            dtype=jnp.float32,
        ),
    ]
    # bf16 only: the dtype a GPU serves in (an f32 compile takes ~1 min, 329 KB spills at 4 warps)
    out.append(_gated_delta("gated_delta chunk C=64 H=32 Dk=Dv=128 bf16"))
    out.append(_ssd("mamba2 ssd chunk C=64 H=64 P=64 N=128 bf16"))
    if full:
        out += [
            _attention(
                f"tuning: decode ctx=32k page=16 tile={cfg.pages_per_block * 16} "
                f"stages={cfg.num_stages} splits={cfg.kv_splits}",
                q_lens=b,
                seqs=b,
                ctx=32768,
                page_size=16,
                config=cfg,
                real_programs=b * 8,
            )
            for cfg in DECODE_TUNING_CANDIDATES
        ]
    return out


@functools.cache
def _ptx_and_info(ir: bytes, warps: int, stages: int) -> tuple[int, int, int, int]:
    kernel = gpu_compile.TritonKernel("k", ir, warps, stages, (1, 1, 1))
    ptx, smem = gpu_compile.compile_to_ptx(kernel)
    info = gpu_compile.ptxas(ptx)
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    return info.registers, info.spill_stores + info.spill_loads, smem, max(waits, default=0)


def compile_variant(v: Variant, gpu: Gpu = H200) -> list[Report]:
    """Lower, compile and assemble `v`; one report per Pallas kernel in it."""
    reports = []
    for k in gpu_compile.lower_triton_kernels(v.fn, *v.shapes):
        if k.ptx is not None:  # newer jaxlib compiled it during lowering
            info = gpu_compile.ptxas(k.ptx)
            waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", k.ptx)]
            regs, spills, smem, wait = (
                info.registers,
                info.spill_stores + info.spill_loads,
                int(k.smem_bytes or 0),
                max(waits, default=0),
            )
        else:
            regs, spills, smem, wait = _ptx_and_info(k.ir, k.num_warps, k.num_stages)
        per_sm = gpu.blocks_per_sm(regs, k.num_warps, smem)
        programs = v.real_programs or k.grid[0] * k.grid[1] * k.grid[2]
        if v.real_programs and "split" in k.name:  # kv_splits multiply the real programs
            programs *= k.grid[2]
        waves = programs / max(1, per_sm * gpu.sms)
        reports.append(
            Report(
                v.name,
                k.name,
                k.grid,
                k.num_warps,
                k.num_stages,
                regs,
                spills,
                smem,
                wait,
                per_sm,
                waves,
                v.decode,
            )
        )
    return reports


def problems(r: Report, gpu: Gpu = H200) -> list[str]:
    """What would fail (or defeat the design) on the GPU; empty = fine."""
    out = []
    if r.smem_bytes > gpu.smem_per_block:
        out.append(f"{r.variant}: {r.smem_bytes} B shared memory > {gpu.smem_per_block} B")
    if r.blocks_per_sm < 1:
        out.append(f"{r.variant}: does not fit on an SM")
    if r.decode and r.spill_bytes:
        out.append(f"{r.variant}: {r.spill_bytes} B register spills in bf16 decode")
    if r.decode and r.max_wait_group < 1:
        out.append(f"{r.variant}: decode K/V loop is single-buffered (cp.async.wait_group 0)")
    return out
