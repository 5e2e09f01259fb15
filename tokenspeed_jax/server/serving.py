"""The completion flow behind /v1/completions and /v1/chat/completions, in the manner of vLLM's
`serving_completion.py` / `serving_chat.py`: the routes in `server.app` only hand a parsed
request to `CompletionService`, which turns it into engine submissions and a response.

A request goes through three stages, each answering for its own failures:
1. the prompt (`create_completion` / `create_chat_completion`): text the tokenizer or the chat
   template cannot take is a 400 naming the field (`prompt` / `messages`);
2. admission (`_admit`): the drain, the request's own checks (unsupported fields, the model,
   the prompt against the context, sampling values), the echo and the queue limit, then
   `AsyncEngine.submit`; every refusal here is an OpenAI error body and nothing was queued;
3. the output (`respond.Completion`, answered by `streaming.sse` or `respond.whole_response`):
   once queued, the request's events feed its choices; a failure then ends this request alone
   (422, 500 or 504: `respond.failure`), and however it ends, its engine requests are aborted so
   their pages come back at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenspeed_jax.server.async_engine import AsyncEngine
from tokenspeed_jax.server.choice import ChoiceState
from tokenspeed_jax.server.drain import Drain
from tokenspeed_jax.server.errors import UnsupportedField, error_response, model_not_found
from tokenspeed_jax.server.events import Deadline, choice_events
from tokenspeed_jax.server.limits import queue_full
from tokenspeed_jax.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenspeed_jax.server.research_routes import ResearchGate
from tokenspeed_jax.server.respond import Completion, tokenizer_call, whole_response
from tokenspeed_jax.server.streaming import sse
from tokenspeed_jax.server.tool_parse import ToolOutput
from tokenspeed_jax.server.tools import ToolPlan, plan_tools, render_prompt

AnyRequest = CompletionRequest | ChatCompletionRequest
# what a route returns: a Response, or the body dict FastAPI serializes (`whole_body`)
Reply = Response | dict[str, Any]


@dataclasses.dataclass
class _Admitted:
    """A request the engine took: its engine request ids, their events' queue, its echo."""

    rids: list[str]
    queue: asyncio.Queue
    echo: str


class CompletionService:
    """What the completion routes share: the model, its tokenizer and limits, the drain, and the
    engine (a getter: the app's lifespan creates it after the routes exist)."""

    def __init__(
        self,
        engine: Callable[[], AsyncEngine],
        tokenizer: Any,
        model_name: str,
        vocab_size: int,
        max_context: int,
        drain: Drain,
        *,
        max_queued_requests: int | None = None,
        request_timeout_s: float | None = None,
        gate: ResearchGate | None = None,
    ) -> None:
        self.engine = engine
        self.gate = gate  # asleep / updating weights: 503 (server.research_routes)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.drain = drain
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s

    # ------------------------------------------------------------------ the two endpoints
    async def create_completion(self, body: CompletionRequest, http: Request) -> Reply:
        try:
            prompt_ids = self.encode(body.prompt)
        except ValueError as e:
            return error_response(400, str(e), param="prompt")
        return await self._run(http, body, prompt_ids, chat=False)

    async def create_chat_completion(self, body: ChatCompletionRequest, http: Request) -> Reply:
        if not body.messages:
            return error_response(400, "messages is empty", param="messages")
        if self.tokenizer is None:
            return error_response(
                400, "this model has no tokenizer (no tokenizer.json): chat needs one", param="messages"
            )
        try:
            plan = plan_tools(
                body.tools, body.tool_choice, body.parallel_tool_calls, constrained=body.constraint()[1]
            )
            messages = [m.as_dict() for m in body.messages]
            prompt_ids = render_prompt(self.tokenizer, messages, plan.rendered if plan else None)
        except UnsupportedField as e:
            return error_response(400, str(e), param=e.field)
        except (ValueError, TypeError) as e:  # TypeError: `tokenizers` refusing a string
            return error_response(400, str(e), param="messages")
        except Exception as e:  # noqa: BLE001 - the tokenizer / chat template refusing them
            return error_response(
                400,
                f"these messages cannot be rendered or tokenized ({type(e).__name__}: {e})",
                param="messages",
            )
        return await self._run(http, body, prompt_ids, chat=True, plan=plan)

    def encode(self, prompt: str | list[int] | list[str]) -> list[int]:
        """A completions prompt as token ids; ValueError (a 400 on `prompt`) when it cannot be."""
        ids = [p for p in prompt if isinstance(p, int)] if isinstance(prompt, list) else []
        if ids and len(ids) == len(prompt):  # token ids as they are
            return ids
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (no tokenizer.json): send token ids")
        if isinstance(prompt, str):
            return tokenizer_call(self.tokenizer.encode, prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return tokenizer_call(self.tokenizer.encode, prompt[0])
        raise ValueError("prompt must be a string, a list of token ids, or a list of one string")

    # ------------------------------------------------------------------ the flow
    async def _run(
        self, http: Request, body: AnyRequest, prompt_ids: list[int], chat: bool, plan: ToolPlan | None = None
    ) -> Reply:
        # the deadline counts from here: admission and queueing are part of the request's time
        deadline = Deadline(self.request_timeout_s)
        if self.drain.draining:
            return self.drain.refusal()
        refusal = None if self.gate is None else self.gate.refusal()
        if refusal is not None:
            return refusal
        admitted = self._admit(body, prompt_ids, chat, plan)
        if isinstance(admitted, Response):
            return admitted
        c = self._completion(http, body, prompt_ids, chat, plan, admitted, deadline)
        if body.stream:
            return StreamingResponse(sse(c), media_type="text/event-stream")
        return await whole_response(c)

    def _admit(
        self, body: AnyRequest, prompt_ids: list[int], chat: bool, plan: ToolPlan | None
    ) -> Response | _Admitted:
        """Check the request and queue it, or the error that refuses it (nothing queued then)."""
        try:
            body.check_supported()
            if body.model is not None and body.model != self.model_name:
                return model_not_found(body.model, self.model_name)
            max_tokens = body.check_prompt(prompt_ids, self.vocab_size, self.max_context)
            constraint = plan.constraint() if plan is not None and plan.forces else body.constraint()
            params = [body.to_params(max_tokens, j, constraint) for j in range(body.n)]
            echo = self._echo(body, prompt_ids) if not chat else ""
            full = queue_full(self.engine().waiting_stats(), self.max_queued_requests)
            if full is not None:
                return full
            rids, queue = self.engine().submit(prompt_ids, params)
        except UnsupportedField as e:
            return error_response(400, str(e), param=e.field)
        except ValueError as e:  # the engine's own checks (the request's were done above)
            return error_response(400, str(e))
        return _Admitted(rids, queue, echo)

    def _echo(self, body: AnyRequest, prompt_ids: list[int]) -> str:
        """The prompt's text a completions request with `echo` gets before its output."""
        if not getattr(body, "echo", False) or self.tokenizer is None:
            return ""
        try:
            return tokenizer_call(self.tokenizer.decode, prompt_ids)
        except ValueError as e:
            raise UnsupportedField("prompt", str(e)) from None

    def _completion(
        self,
        http: Request,
        body: AnyRequest,
        prompt_ids: list[int],
        chat: bool,
        plan: ToolPlan | None,
        admitted: _Admitted,
        deadline: Deadline,
    ) -> Completion:
        """The admitted request's choices and the events that feed them."""
        stops = body.stop_strings()
        choices = [ChoiceState(j, self.tokenizer, stops) for j in range(body.n)]
        tool_out = [ToolOutput(plan) if plan is not None and plan.parses else None for _ in choices]
        events = choice_events(
            self.engine(), admitted.queue, choices, admitted.rids, http, deadline, self.drain.aborting
        )
        for ch in choices:  # completions logprobs' text offsets count the echoed prompt
            ch.text_offset = len(admitted.echo)
        top_k = body.num_top_logprobs()
        meta = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
            "created": int(time.time()),
            "model": self.model_name,
            # the weights that answer it (`LLM.update_weights`; updates wait for no request
            # to be live, so the version at admission is the version that generates)
            "weight_version": self.engine().engine.weight_version,
        }
        return Completion(
            body,
            chat,
            len(prompt_ids),
            choices,
            tool_out,
            admitted.echo,
            meta,
            admitted.rids,
            events,
            self.engine(),
            top_k,
        )
