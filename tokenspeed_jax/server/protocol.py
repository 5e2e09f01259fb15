"""Request bodies of the OpenAI-compatible endpoints (pydantic) and their mapping to params."""

from __future__ import annotations

from pydantic import BaseModel, Field

from tokenspeed_jax.sampling_params import SamplingParams


class _Sampling(BaseModel):
    model: str | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    logprobs: bool | int | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def to_params(self, default_max_tokens: int) -> SamplingParams:
        """ValueError (-> HTTP 400) on bad values, naming the field."""
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            logprobs=bool(self.logprobs),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    echo: bool = False


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
