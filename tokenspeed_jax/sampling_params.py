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
    top_logprobs: also return the k (<= 20) most likely tokens and their logprobs at each step.
    presence_penalty / frequency_penalty in [-2, 2] (0 = off), repetition_penalty > 0 (1 = off)
    and logit_bias ({token id: bias in [-100, 100]}) modify the logits before sampling, on the
    device (OpenAI / vLLM semantics, see `tokenspeed_jax.runtime.sampling`); requests using a penalty do
    not take prefix-cache hits (their token counts are rebuilt from their own inputs).
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
        k = self.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20:
            raise ValueError(f"SamplingParams.top_logprobs must be an int in [0, 20], got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not 0.0 < r <= 1e4 or math.isinf(r):
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {r!r}")
        if self.logit_bias is not None:
            try:
                bias = {int(t): float(b) for t, b in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"SamplingParams.logit_bias must map token ids to numbers, got "
                                 f"{self.logit_bias!r:.80}") from None
            bad = [t for t, b in bias.items() if t < 0 or not -100.0 <= b <= 100.0]
            if bad:
                raise ValueError(f"SamplingParams.logit_bias: token {bad[0]} needs an id >= 0 and "
                                 f"a bias in [-100, 100]")
            object.__setattr__(self, "logit_bias", bias)
