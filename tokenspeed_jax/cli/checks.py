"""Command-line argument checks that run before anything heavy loads.

argparse `type=` validators (one clear message each) and `preflight`, which checks the numbers
that depend on the model's cache layout (pages for the largest request, context length) from
the model's config alone: no weights are read and nothing is compiled.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeVar

_N = TypeVar("_N", int, float)

DTYPES = ("float32", "bfloat16", "float16", "auto")
# = runtime.backends.BACKENDS (this module stays jax-free; tests/tokenspeed_jax/test_cli.py checks)
ATTENTION_BACKENDS = ("auto", "pallas", "reference", "native")
# = pallas_kernels.kv_quant.KV_CACHE_DTYPES and models.quant.WEIGHT_QUANTIZATIONS (same test)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
WEIGHT_QUANTIZATIONS = ("int8", "w8a8", "q8_0", "gguf")


def _at_least(kind: type[_N], lo: _N, expected: str) -> Callable[[str], _N]:
    """argparse `type=`: parse `kind`, >= lo (NaN fails too), else a clear error."""
    def parse(text: str) -> _N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not value >= lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    parse.__name__ = f"{kind.__name__}>={lo}"  # argparse names the type in its messages
    return parse


def int_at_least(lo: int) -> Callable[[str], int]:
    return _at_least(int, lo, "an integer")


def float_at_least(lo: float) -> Callable[[str], float]:
    return _at_least(float, lo, "a number")


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_count(text: str) -> int:
    """argparse `type=`: a positive byte count, vLLM's spelling: a plain int, or a number with
    a lower-case (decimal: 4g = 4e9) or upper-case (binary: 4G = 4 GiB) k/m/g/t suffix."""
    t = text.strip()
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = float(t[:len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes like 4G or 4000000000, got {text!r}"
                                         ) from None
    if not 1 <= value < 2**63:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return int(value)


def port(text: str) -> int:
    value = int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {value}")
    return value


def _model_config(model: str, dtype: str):
    """The model's config without its weights; None when that needs the full loader."""
    from tokenspeed_jax.models import registry

    if model in registry.BUILTIN_MODELS:
        return registry.tiny_random_config()
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        from tokenspeed_jax.hf import load_config

        return load_config(model, dtype=dtype)
    return None


def pool_pages(args) -> int | None:
    """--num-pages; else the command's default, unless --kv-cache-memory-bytes sizes the pool
    (None: the engine sizes it)."""
    if args.num_pages is not None or args.kv_cache_memory_bytes is not None:
        return args.num_pages
    return args.default_num_pages


def preflight(args, *, longest_request: int | None) -> str | None:
    """An error message for arguments that cannot work with this model, else None.

    longest_request: tokens (prompt + output) of the longest request the command will send
    (`run` knows it from the workload); None = one request of the full context (`serve`)."""
    from tokenspeed_jax.models import registry

    if args.num_pages is not None and args.kv_cache_memory_bytes is not None:
        return "--num-pages and --kv-cache-memory-bytes both size the page pool: give one"
    model = args.model
    aliases = getattr(registry, "MODEL_ALIASES", {})
    if model not in registry.BUILTIN_MODELS and model not in aliases and not os.path.exists(model):
        known = ", ".join((*registry.BUILTIN_MODELS, *aliases))
        return f"--model {model!r}: not a built-in model ({known}) nor an existing path"
    if args.dtype not in DTYPES:
        return f"--dtype {args.dtype!r}: expected one of {', '.join(DTYPES)}"
    try:
        cfg = _model_config(model, args.dtype)
    except ValueError as e:
        return f"--model {model!r}: {e}"
    if cfg is None:
        return None
    from scheduler import Scheduler, SchedulerConfig, cache_layout
    from tokenspeed_jax.llm import default_context_len

    ctx = default_context_len(model, cfg) if args.max_context_len is None else args.max_context_len
    total = ctx if longest_request is None else longest_request
    if total > ctx:
        return (f"the longest request ({total} tokens) exceeds --max-context-len {ctx}: raise it "
                f"or shorten the workload")
    num_pages = pool_pages(args)
    if num_pages is None:
        return None
    layout = cache_layout(SchedulerConfig(num_pages=num_pages, page_size=args.page_size,
                                          max_batch_requests=args.max_batch_requests,
                                          max_scheduled_tokens=args.max_scheduled_tokens,
                                          max_context_len=ctx), cfg)
    sched = Scheduler(layout.scheduler_config)
    need = sched.coord.solo_peak_pages(total, args.max_scheduled_tokens)
    if need > num_pages - 1:
        return (f"--num-pages {num_pages}: a {total}-token request needs {need + 1} pages "
                f"(page 0 is reserved); raise --num-pages or lower --max-context-len")
    return None
