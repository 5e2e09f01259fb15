"""Command-line argument checks that run before anything heavy loads.

argparse `type=` validators (one clear message each) and `preflight`, which checks the numbers
that depend on the model's cache layout (pages for the largest request, context length) from
the model's config alone: no weights are read and nothing is compiled.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenspeed_jax.engine_args import _at_least, int_at_least

if TYPE_CHECKING:
    from tokenspeed_jax.engine_args import EngineArgs


def float_at_least(lo: float) -> Callable[[str], float]:
    return _at_least(float, lo, "a number")


def port(text: str) -> int:
    value = int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {value}")
    return value


def _model_config(model: str, dtype: str):
    """The model's config without its weights; None when that needs the full loader."""
    from tokenspeed_jax.models import registry

    if model in registry.BUILTIN_MODELS:
        return registry.builtin_config(model)
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        from tokenspeed_jax.hf import load_config

        return load_config(model, dtype=dtype)
    return None


def preflight(args: EngineArgs, *, longest_request: int | None) -> str | None:
    """An error message for options that cannot work with this model, else None: checked from
    the model's config alone (no weights read, nothing compiled, no Scheduler built).

    longest_request: tokens (prompt + output) of the longest request the command will send
    (`run` knows it from the workload); None = one request of the full context (`serve`)."""
    from tokenspeed_jax.models import registry

    if None in (args.dtype, args.max_batch_requests, args.max_scheduled_tokens):
        from tokenspeed_jax.engine_args import detect_platform

        args = args.for_platform(detect_platform())
    model = args.model
    aliases = getattr(registry, "MODEL_ALIASES", {})
    if model not in registry.BUILTIN_MODELS and model not in aliases and not os.path.exists(model):
        known = ", ".join((*registry.BUILTIN_MODELS, *aliases))
        return f"--model {model!r}: not a built-in model ({known}) nor an existing path"
    try:
        cfg = _model_config(model, args.dtype or "auto")
    except ValueError as e:
        return f"--model {model!r}: {e}"
    if cfg is None:
        return None
    from scheduler import SchedulerConfig, cache_layout
    from scheduler.coordinator import solo_peak_by_pool
    from tokenspeed_jax.engine_args import default_context_len

    ctx = default_context_len(model, cfg) if args.max_context_len is None else args.max_context_len
    total = ctx if longest_request is None else longest_request
    if total > ctx:
        return (
            f"the longest request ({total} tokens) exceeds --max-context-len {ctx}: raise it "
            f"or shorten the workload"
        )
    if args.num_pages is None:
        return None
    layout = cache_layout(
        SchedulerConfig(num_pages=args.num_pages, page_size=args.page_size, max_context_len=ctx),
        cfg,
        conv_page_size=args.conv_page_size,
        state_page_size=args.state_page_size,
    )
    specs = list(layout.scheduler_config.groups or ())
    assert args.max_scheduled_tokens is not None  # resolved above
    # with --num-state-pages the state groups are on a pool of their own, counted apart
    state = args.num_state_pages
    needs = solo_peak_by_pool(specs, total, args.max_scheduled_tokens, state is not None)
    sizes = (args.num_pages,) if state is None else (args.num_pages, state)
    for flag, pages, need in zip(("--num-pages", "--num-state-pages"), sizes, needs):
        if need > pages - 1:
            return (
                f"{flag} {pages}: a {total}-token request needs {need + 1} pages "
                f"(page 0 is reserved); raise {flag} or lower --max-context-len"
            )
    return None
