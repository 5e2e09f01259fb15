"""Structured output: per-request grammars (JSON schema, any JSON object, regex, choice, Lark /
GBNF grammar) matched on the host with llguidance; the token bitmask they allow is applied to
the logits on the device (`runtime.sampling.apply_token_mask`).

- `spec`: the `structured_outputs` dict of `SamplingParams` -> one llguidance grammar (checked);
- `vocab`: our tokenizers as llguidance tokenizers;
- `book`: `GrammarBook`, the live matchers of one engine, the step's bitmask, their timing.
"""

from __future__ import annotations

from tokenspeed_jax.structured.book import GrammarBook
from tokenspeed_jax.structured.spec import KINDS, compile_spec

__all__ = ["KINDS", "GrammarBook", "compile_spec"]
