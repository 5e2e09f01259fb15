"""Result records returned by `LLM.generate` and the engine."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_retractions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    """One finished request. `token_ids` are the generated ids (a stop token is the last one)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "length" | "stop" | "abort"
    text: str | None = None
    logprobs: list[float] | None = None  # log-probability of each generated token
    prompt_logprobs: list[float | None] | None = None  # of prompt token j given < j; None at j=0
    # per generated token: the k most likely (token id, logprob) pairs, when top_logprobs = k > 0
    top_logprobs: list[list[tuple[int, float]]] | None = None
    metrics: RequestMetrics | None = None
    # `LLM.weight_version` of the weights that generated it (rollouts matched to their policy)
    weight_version: int = 0

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        m = self.metrics
        if m is None or m.first_token_time is None or m.finish_time is None or len(self.token_ids) < 2:
            return None
        return (m.finish_time - m.first_token_time) / (len(self.token_ids) - 1)
