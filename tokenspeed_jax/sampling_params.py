"""`SamplingParams` (SPEC.md) with up-front validation."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    max_tokens: tokens to generate at most. temperature 0 = greedy. top_p in (0, 1]; top_k -1 =
    all. seed: reproduces the same tokens whatever else is in the batch (None = derived from the
    request id). stop_token_ids: generation ends on one of these (it is the last token returned);
    the model's EOS is added unless `ignore_eos`. logprobs: return the log-probability of each
    generated token; prompt_logprobs: of each prompt token given the tokens before it.
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

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (all) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"SamplingParams.seed must be None or an int >= 0, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if any(not isinstance(s, int) or s < 0 for s in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be ints >= 0, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", stops)
