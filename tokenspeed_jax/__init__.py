"""tokenspeed-jax runtime: page tables, pools, models, runner, engine, server, CLI."""

from __future__ import annotations

from tokenspeed_jax.llm import LLM
from tokenspeed_jax.outputs import CompletionOutput
from tokenspeed_jax.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"
