"""Request bodies of the OpenAI-compatible endpoints (pydantic) and their mapping to params.

Unknown fields are rejected (HTTP 400 naming the field) rather than silently ignored, and so
are OpenAI fields this server does not implement (`UNSUPPORTED`) when they carry a value.
Output constraints (`response_format`, vLLM's `guided_*` and `structured_outputs`) are mapped by
`tokenspeed_jax.server.structured`; tools (chat only) by `tokenspeed_jax.server.tools`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from scheduler.sampling_options import LIMITS, ParamError
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.server.errors import UnsupportedField
from tokenspeed_jax.server.structured import field_error, request_constraint

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "UNSUPPORTED", "UnsupportedField"]

# bounds checked by pydantic (a 400 naming the field) come from the scheduler's one limits table
_MAX_TOP_LOGPROBS = int(LIMITS["top_logprobs"].hi)

# OpenAI request fields that exist but are not implemented here: a non-null value is a 400.
UNSUPPORTED = (
    "functions",
    "function_call",
    "suffix",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
)


def _unicode(text: str) -> str:
    """JSON may carry a lone surrogate ("\\ud800"), which no tokenizer can encode (the `tokenizers`
    library raises TypeError, far from any error handling): refused here, a 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode (lone surrogate at index {e.start})") from None
    return text


# a request string that reaches the tokenizer or the stop matcher
Text = Annotated[str, AfterValidator(_unicode)]

# (structured_outputs dict or None, the request field it came from)
Constraint = tuple[dict[str, Any] | None, str | None]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None  # None = up to the context limit
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=int(LIMITS["seed"].lo))
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # output constraints (`tokenspeed_jax.server.structured`)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # declared so that a value is reported as unsupported, not as an unknown field
    functions: list | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: list | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None

    def check_supported(self) -> None:
        for name in UNSUPPORTED:
            if getattr(self, name, None) is not None:
                raise UnsupportedField(name)
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options needs stream=true")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def num_top_logprobs(self) -> int:
        raise NotImplementedError

    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def constraint(self) -> Constraint:
        """The output constraint this request asks for (UnsupportedField if two at once)."""
        return request_constraint(self)

    def to_params(
        self, max_tokens: int, index: int = 0, constraint: Constraint = (None, None)
    ) -> SamplingParams:
        """Params of sample `index` of this request (seed + index, so n samples differ), under
        `constraint` (`constraint()`, or the one tool_choice implies). ValueError (-> HTTP 400)
        on bad values, naming the field."""
        spec, field = constraint
        seed = None if self.seed is None else (self.seed + index) & 0xFFFFFFFF
        bias = dict(zip(self.bias_ids(), (self.logit_bias or {}).values()))
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=seed,
                stop_token_ids=tuple(self.stop_token_ids),
                logprobs=self.wants_logprobs(),
                top_logprobs=self.num_top_logprobs(),
                ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=bias or None,
                structured_outputs=spec,
            )
        except ParamError as e:
            if field is not None and e.param == "structured_outputs":
                raise field_error(field, e) from None
            sent = self.request_field(e.param)
            raise UnsupportedField(sent, str(e).replace(f"SamplingParams.{e.param}", sent, 1)) from None

    def request_field(self, name: str) -> str:
        """The request field a `SamplingParams` field's value came from (an error names what
        the client sent, not an internal name)."""
        return "logprobs" if name == "top_logprobs" else name

    def bias_ids(self) -> list[int]:
        """The token ids `logit_bias` is keyed by (JSON keys are strings)."""
        try:
            return [int(k) for k in self.logit_bias or {}]
        except ValueError:
            raise UnsupportedField("logit_bias", "logit_bias keys must be token ids") from None

    def check_prompt(self, prompt_ids: list[int], vocab_size: int, max_context: int) -> int:
        """The max tokens to generate for `prompt_ids` (the one asked for, else up to the context
        limit), after the engine's request checks done here first, so that a refusal names the
        request field it is about (UnsupportedField -> 400): an empty prompt or one with ids
        outside the vocabulary, stop ids or logit_bias keys outside it, no room to generate."""
        if not prompt_ids:
            raise UnsupportedField(self.prompt_field, f"{self.prompt_field}: the prompt is empty")
        for field, ids in (
            (self.prompt_field, prompt_ids),
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.bias_ids()),
        ):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise UnsupportedField(
                    field, f"{field}: token id {bad} outside the vocabulary [0, {vocab_size})"
                )
        wanted = self.requested_max_tokens()
        max_tokens = wanted if wanted is not None else max_context - len(prompt_ids)
        if len(prompt_ids) + max(max_tokens, 1) > max_context:
            field = self.request_field("max_tokens") if wanted is not None else self.prompt_field
            raise UnsupportedField(
                field,
                f"{field}: the prompt ({len(prompt_ids)} tokens) + "
                f"{max(max_tokens, 1)} tokens to generate exceed the "
                f"model's context of {max_context} tokens",
            )
        return max_tokens

    prompt_field: ClassVar[str] = "prompt"


class CompletionRequest(_Sampling):
    prompt: Text | list[int] | list[Text]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=_MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedField("best_of", "best_of other than n is not supported")

    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    """A call in an assistant message of the history (as this server returned it)."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = None  # a client may echo the calls it accumulated from a stream


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # clients echo it back on assistant messages; ignored

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it (content as text, "" when null)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude={"index"}) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise UnsupportedField(
                    "messages", f"message content of type {part.type!r} is not supported (text only)"
                )
            out.append(part.text)
        return "".join(out)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=_MAX_TOP_LOGPROBS)
    store: bool | None = None
    metadata: dict | None = None
    # function tools (`tokenspeed_jax.server.tools` checks them: a 400 names the field)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs=true")

    prompt_field: ClassVar[str] = "messages"

    def request_field(self, name: str) -> str:
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return name

    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
