"""tokenspeed-jax runtime: page tables, pools, models, runner, engine, server, CLI.

The top-level names load on first use (PEP 562), so `import tokenspeed_jax.<module>` pulls in only
what that module needs: the CLI's argument parsing, the workload definition and the HTTP load
generator of `bench serve` never import jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenspeed_jax.llm import LLM
    from tokenspeed_jax.outputs import CompletionOutput
    from tokenspeed_jax.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"
_HOMES = {
    "LLM": "tokenspeed_jax.llm",
    "CompletionOutput": "tokenspeed_jax.outputs",
    "SamplingParams": "tokenspeed_jax.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'tokenspeed_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
