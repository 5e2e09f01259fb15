"""What the single-engine benchmarks share: the engine flags, the `LLM` keywords they make, and
the timing of one step shape on all-padding inputs (the dense work is fixed per shape; the CPU
attention loops over real tokens only, so an all-padding step times everything BUT the
attention: docs/performance.md)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def add_engine_args(p: argparse.ArgumentParser, *, max_batch_requests: int = 32,
                    max_scheduled_tokens: int = 512, max_context_len: int | None = None) -> None:
    """--model, --max-context-len, --max-batch-requests, --max-scheduled-tokens, --num-pages,
    --dtype, --kv-cache-dtype, --quantization, --min-token-bucket, --attention-backend
    (defaults per benchmark)."""
    from pallas_kernels.kv_quant import KV_CACHE_DTYPES
    from tokenspeed_jax.models.quant import WEIGHT_QUANTIZATIONS
    from tokenspeed_jax.runtime.backends import BACKENDS

    p.add_argument("--model", default="tiny-random")
    p.add_argument("--max-context-len", type=int, default=max_context_len)
    p.add_argument("--max-batch-requests", type=int, default=max_batch_requests)
    p.add_argument("--max-scheduled-tokens", type=int, default=max_scheduled_tokens)
    p.add_argument("--num-pages", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--quantization", default=None, choices=WEIGHT_QUANTIZATIONS)
    p.add_argument("--min-token-bucket", type=int, default=None,
                   help="default: the engine's (16, plus 1 for a lone decode on CPU)")
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS)


def llm_kwargs(args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    """`LLM(args.model, **llm_kwargs(args, ...))` keywords of `add_engine_args`' flags (no
    max_context_len when --max-context-len is unset: the model's default) plus `more`."""
    kw = dict(max_batch_requests=args.max_batch_requests, num_pages=args.num_pages,
              max_scheduled_tokens=args.max_scheduled_tokens, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
              min_token_bucket=args.min_token_bucket,
              attention_backend=args.attention_backend, **more)
    if args.max_context_len is not None:
        kw["max_context_len"] = args.max_context_len
    return kw


def padding_step_ms(runner: Any, padding: Any, shape: Any, reps: int, *, warm: int = 1) -> float:
    """Median milliseconds of `reps` all-padding steps of `shape` after `warm` untimed ones
    (made ready first if it is not: compiled, or read from the executable store). No attention
    work on the reference backend: its loops run the step's real tokens only."""
    import jax

    from tokenspeed_jax.runtime.step_inputs import pack

    runner.programs.prepare(shape)
    i32, f32 = pack(padding, runner.step_layout(shape))
    times = []
    for _ in range(warm + reps):
        t = time.perf_counter()
        jax.block_until_ready(runner.execute(shape, i32, f32))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[warm:])
