"""`SamplingParams` (SPEC.md) with up-front validation."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable
from typing import Any

from scheduler.sampling_options import LIMITS, ParamError, SamplingOptions, check


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    max_tokens: tokens to generate at most. temperature 0 = greedy. top_p in (0, 1]; top_k -1 =
    all. seed: reproduces the same tokens whatever else is in the batch (None = derived from the
    request id). stop_token_ids: generation ends on one of these (it is the last token
    returned; None = none); the model's EOS is added unless `ignore_eos`. logprobs: return the
    log-probability of each generated token; prompt_logprobs: of each prompt token given the
    tokens before it. top_logprobs: also return the k most likely tokens and their logprobs at
    each step. presence_penalty / frequency_penalty (0 = off), repetition_penalty (1 = off) and
    logit_bias ({token id: bias}) modify the logits before sampling, on the device (OpenAI /
    vLLM semantics, see `tokenspeed_jax.runtime.sampling`); requests using a penalty do not take
    prefix-cache hits (their token counts are rebuilt from their own inputs).
    structured_outputs: constrain the output with exactly one of {"json": schema},
    {"json_object": True}, {"regex": pattern}, {"choice": [str, ...]} or {"grammar": Lark or
    GBNF text} (vLLM's spelling; see `tokenspeed_jax.structured.spec`). Compiled and checked
    here; the request ends ("stop") when the grammar is complete, and `length` leaves a valid
    prefix.
    Every field but max_tokens, logprobs, ignore_eos and structured_outputs is validated with
    the scheduler's one limits table (`scheduler.sampling_options.LIMITS`; an error names the
    field and its rule), and `to_options()` builds the scheduler's record of them. A refused
    value raises `ParamError` (a ValueError) whose `param` is the field's name.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    prompt_logprobs: bool = False
    ignore_eos: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, numbers.Integral)
            or self.max_tokens < 1
        ):
            raise ParamError(
                "max_tokens", f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}"
            )
        object.__setattr__(self, "max_tokens", int(self.max_tokens))  # numpy ints too
        for f in dataclasses.fields(self):
            if f.name in LIMITS:  # normalised: numbers as int / float, stop ids a tuple
                value = check(f.name, getattr(self, f.name), "SamplingParams.")
                if f.name == "logit_bias":
                    value = None if self.logit_bias is None else dict(value)
                object.__setattr__(self, f.name, value)
        if self.structured_outputs is not None:
            from tokenspeed_jax.structured.spec import compile_spec

            spec = (
                dict(self.structured_outputs)
                if isinstance(self.structured_outputs, dict)
                else self.structured_outputs
            )
            try:
                grammar = compile_spec(spec)  # ValueError naming structured_outputs.<kind>
            except ValueError as e:
                raise ParamError("structured_outputs", str(e)) from None
            object.__setattr__(self, "structured_outputs", spec)
            object.__setattr__(self, "_grammar", grammar)

    @property
    def grammar(self) -> str | None:
        """The llguidance grammar compiled from `structured_outputs` (None = unconstrained)."""
        return getattr(self, "_grammar", None)

    def to_options(self, eos_token_ids: Iterable[int] = ()) -> SamplingOptions:
        """The scheduler's sampling record of these params (its fields of the same names); the
        model's `eos_token_ids` join the stop ids unless `ignore_eos`."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in LIMITS}
        if not self.ignore_eos:
            values["stop_token_ids"] = (*self.stop_token_ids, *eos_token_ids)
        return SamplingOptions.from_options(values)
