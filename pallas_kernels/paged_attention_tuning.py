"""Tuning of the paged-attention kernel: its static config record, the shape heuristic that picks
one, and the alternatives the GPU benchmark and the sm_90a compile check both walk (JAX's ragged
paged attention keeps its tuned block sizes beside the kernel the same way)."""

from __future__ import annotations

import dataclasses

from pallas_kernels import backend

__all__ = [
    "DECODE_TUNING_CANDIDATES",
    "MixedConfig",
    "PagedAttentionConfig",
    "default_config",
    "mixed_config",
]


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tuning knobs (all static). Validated on construction and against the inputs.

    pages_per_block: pages per inner-loop K/V tile; `pages_per_block * page_size` (the tile's
      token count) must be a power of two >= 16 (Triton tile/MMA constraints).
    block_q: query tokens per program (power of two). Rows per program = block_q * next_pow2(G)
      and must be >= 16 (Triton's minimum MMA M). Small for decode, larger for prefill.
    num_warps, num_stages: Triton launch / software-pipelining parameters; num_stages >= 3 keeps
      num_stages - 1 K/V tiles in flight (2 stages compile to a single-buffered loop).
    kv_splits: split each block's key range over this many programs (flash-decoding); partial
      (acc, max, denominator) go to float32 buffers and are merged with jnp. Helps when
      requests x kv heads alone cannot fill the GPU (few long decodes).
    """

    pages_per_block: int = 4
    block_q: int = 4
    num_warps: int = 4
    num_stages: int = 3
    kv_splits: int = 1

    def __post_init__(self) -> None:
        backend.check_config(self, powers_of_2=("pages_per_block", "block_q", "num_warps"))


# Occupancy the decode default reaches on an H100/H200 (132 SMs): 3 programs per SM at ~148
# registers and 70 KiB shared memory (benchmarks/kernel_compile.py prints the measured values).
_SMS, _DECODE_PROGRAMS_PER_SM, _MIN_WAVES = 132, 3, 4


def default_config(
    num_tokens: int, num_seqs_max: int, page_size: int, group: int, num_kv_heads: int = 1, max_pages: int = 0
) -> PagedAttentionConfig:
    """Static heuristic: decode-dominated shapes (<= 2 query tokens per request on average) use
    the minimum 16 rows per program (each K/V tile serves all G heads; more rows would only burn
    tensor-core time on padding); prefill-heavy shapes use 64 rows for arithmetic intensity.
    K/V tiles are 64 tokens, with 3 pipeline stages (two bf16 D=128 K+V tiles in flight while
    one is consumed, cp.async.wait_group 2 in the PTX: 70 KiB of shared memory for decode,
    112 KiB for prefill, whose 176 registers x 8 warps allow 1 program/SM anyway). Decode splits
    the key range (flash-decoding) until requests x kv heads x splits fills >= 4 waves of
    3 programs on each of 132 SMs, so the last, partial wave costs little, as long as every
    split still gets >= 4 tiles at full context (at most 32 splits)."""
    gp = backend.next_power_of_2(group)
    decode = num_tokens <= 2 * num_seqs_max
    rows = 16 if decode else 64
    pages_per_block = max(1, 64 // page_size)
    splits = 1
    if decode:
        target = _MIN_WAVES * _SMS * _DECODE_PROGRAMS_PER_SM
        while (
            splits < 32
            and num_seqs_max * num_kv_heads * splits < target
            and max_pages >= 2 * splits * 4 * pages_per_block
        ):
            splits *= 2
    return PagedAttentionConfig(
        pages_per_block=pages_per_block,
        block_q=max(1, rows // gp),
        num_warps=4 if decode else 8,
        num_stages=3,
        kv_splits=splits,
    )


@dataclasses.dataclass(frozen=True)
class MixedConfig:
    """Two launches for a batch that mixes decodes with prefill chunks: requests with at most
    `decode.block_q` query tokens run first, one block each, with `decode` (16 rows); the rest
    then run with `prefill` into the same (aliased) output. One launch at the prefill config
    gives each decode token a 64-row block (16x the tensor-core work it needs) at one program
    per SM. On the H200 (bf16, 32 q / 8 kv heads, benchmarks/kernels.py): 60 decodes at 8k +
    4 x 512-token chunks 2.13 -> 1.64 ms, 31 decodes at 2k + one 512-token chunk 0.247 ->
    0.163 ms."""

    decode: PagedAttentionConfig
    prefill: PagedAttentionConfig


def mixed_config(
    num_tokens: int, num_seqs_max: int, page_size: int, group: int, num_kv_heads: int = 1, max_pages: int = 0
) -> MixedConfig | None:
    """The two-launch config for prefill-shaped batches of several requests; None where one
    launch is the right shape (decode-dominated, or a single request). The decode launch does
    not split the key range: its partials would be sized by ALL the batch's tokens (T x Hq x D
    float32 per split), and on the H200 splitting cost 40% at 31 decodes + a 512-token chunk
    (0.227 vs 0.163 ms) for 3% gained at 60 decodes at 8k + 2k prefill tokens."""
    if num_tokens <= 2 * num_seqs_max or num_seqs_max < 2:
        return None
    decode = default_config(num_seqs_max, num_seqs_max, page_size, group, num_kv_heads, max_pages)
    return MixedConfig(
        decode=dataclasses.replace(decode, kv_splits=1),
        prefill=default_config(num_tokens, num_seqs_max, page_size, group, num_kv_heads, max_pages),
    )


# Alternatives to the decode default (tile size, pipeline stages, kv_splits) for 32k-context
# decode at page 16: benchmarks/kernels.py times them on the GPU and compile_check.variants()
# compiles them for sm_90a (registers, spills, pipelining depth), so both tables cover one list.
DECODE_TUNING_CANDIDATES: tuple[PagedAttentionConfig, ...] = (
    PagedAttentionConfig(pages_per_block=2, block_q=4, num_stages=3, kv_splits=4),
    PagedAttentionConfig(pages_per_block=4, block_q=4, num_stages=2, kv_splits=4),
    PagedAttentionConfig(pages_per_block=4, block_q=4, num_stages=4, kv_splits=4),
    PagedAttentionConfig(pages_per_block=8, block_q=4, num_stages=2, kv_splits=4),
    PagedAttentionConfig(pages_per_block=4, block_q=4, num_stages=3, kv_splits=2),
)
