"""FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (streaming via SSE), /health,
/stats, /metrics.

OpenAI conformance: n samples, stop strings, logprobs / top_logprobs, penalties, logit_bias,
seed, stream_options.include_usage; structured outputs (response_format, vLLM's guided_* and
structured_outputs: `server.structured`) and function tools on chat (`server.tools`,
`server.tool_parse`); unsupported or unknown fields, bad values and malformed JSON
get HTTP 400 and an unknown model 404 (`model_not_found`), all in OpenAI's error body. A client
that disconnects (streaming or not) has its requests aborted: their pages come back at once.
`/health` answers 503 until every replica has compiled its step shapes, and again while the
server drains for a shutdown (`server.drain`). A request past `request_timeout_s` is aborted:
504 (`request_timeout`), or a final error event when streaming (`server.events`).

One request's failure stays its own: a prompt the tokenizer or chat template cannot take is a
400 naming the field; a failure while its output is produced (detokenizing, logprob records, tool
parsing) is a 422 `request_failed` (an error event when streaming), and the others go on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenspeed_jax.engine.replicas import aggregate_stats
from tokenspeed_jax.server.async_engine import AsyncEngine
from tokenspeed_jax.server.auth import ApiKeyMiddleware
from tokenspeed_jax.server.choice import ChoiceState
from tokenspeed_jax.server.drain import DEFAULT_SHUTDOWN_GRACE_S, Drain
from tokenspeed_jax.server.errors import error_event, error_response, install_error_handlers
from tokenspeed_jax.server.events import Deadline, Disconnected, TimedOut, choice_events
from tokenspeed_jax.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware, queue_full
from tokenspeed_jax.server.metrics import ServerMetrics
from tokenspeed_jax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedField,
)
from tokenspeed_jax.server.respond import failure, tokenizer_call, whole_body
from tokenspeed_jax.server.tokenize_routes import add_tokenize_routes
from tokenspeed_jax.server.tool_parse import ToolOutput
from tokenspeed_jax.server.tools import ToolPlan, plan_tools, render_prompt

log = logging.getLogger("tokenspeed_jax.server")


def describe(llm, model_name: str) -> str:
    """The one startup line: model, dtype, pages, page size, max context, buckets, backend."""
    e = llm.engines[0]
    cfg, runner = e.scheduler.config, e.runner
    return (f"model={model_name} dtype={getattr(llm, 'dtype', '?')} replicas={len(llm.engines)} "
            f"pages={cfg.num_pages - 1} page_size={cfg.page_size} "
            f"max_context={cfg.max_context_len} max_batch={cfg.max_batch_requests} "
            f"buckets={list(getattr(runner, 'buckets', ()))} "
            f"backend={getattr(runner, 'backend', '?')}")


def build_app(llm, model_name: str = "tiny-random", *, warmup: bool = True,
              route: str = "prefix", api_keys: Sequence[str] = (),
              metrics_require_key: bool = False,
              max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
              max_queued_requests: int | None = None, request_timeout_s: float | None = None,
              shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> FastAPI:
    """The server app over every data-parallel replica of `llm` (`llm.engines`), routing requests
    by `route` ("prefix", the default, or "load": `tokenspeed_jax.engine.replicas`).

    api_keys: bearer keys every route but /health (and /metrics, /stats unless
    `metrics_require_key`) needs (`server.auth`; none = open). max_request_bytes: larger bodies
    get 413 before parsing (None = no limit); max_queued_requests: 503 + Retry-After once the
    engine holds that many waiting requests (None = unlimited; `server.limits`).
    request_timeout_s: abort a request not done after that long (None = never).
    shutdown_grace_s: what in-flight requests get to finish once a shutdown begins
    (`server.drain.Drain`, on `app.state.drain`; `server.drain.serve` runs the app with it)."""
    tokenizer = llm.tokenizer
    max_context = llm.engine.scheduler.config.max_context_len
    vocab_size = llm.model_config.vocab_size
    holder: dict = {}
    metrics = ServerMetrics(lambda: holder["engine"].stats())
    drain = Drain(shutdown_grace_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine = AsyncEngine(llm.engines, warmup=warmup, on_finish=metrics.observe,
                             on_scheduled=metrics.observe_queue_time, route=route)
        holder["engine"] = engine
        _app.state.engine = engine
        drain.live, drain.abort_rest = engine.num_live, engine.abort_all
        log.info("tokenspeed-jax serving: %s (warming up)", describe(llm, model_name))
        yield
        engine.shutdown()

    app = FastAPI(title="tokenspeed-jax", lifespan=lifespan)
    app.state.drain = drain
    install_error_handlers(app)
    if max_request_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_keys:  # added last: outermost, so it answers before the body is read
        app.add_middleware(ApiKeyMiddleware, keys=list(api_keys),
                           require_key_for_metrics=metrics_require_key)
    add_tokenize_routes(app, tokenizer, model_name, max_context, vocab_size)

    def engine() -> AsyncEngine:
        return holder["engine"]

    @app.get("/health")
    def health():
        if drain.draining:
            return JSONResponse(status_code=503, content={"status": "draining"})
        if "engine" not in holder or not engine().ready:
            return JSONResponse(status_code=503, content={"status": "warming up"})
        return {"status": "ok"}

    @app.get("/stats")
    def stats():
        return aggregate_stats(engine().stats())

    @app.get("/metrics")
    def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "tokenspeed-jax",
            "max_model_len": max_context}]}

    def _encode(prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            return list(prompt)
        if tokenizer is None:
            raise ValueError("this model has no tokenizer (no tokenizer.json): send token ids")
        if isinstance(prompt, str):
            return tokenizer_call(tokenizer.encode, prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return tokenizer_call(tokenizer.encode, prompt[0])
        raise ValueError("prompt must be a string, a list of token ids, or a list of one string")

    def _abort(rids: list[str], reason: str | None = None) -> None:
        for rid in rids:  # no-op once finished; frees pages otherwise
            engine().abort(rid, finish_reason=reason)

    async def _run(http: Request, body, prompt_ids: list[int], chat: bool,
                   plan: ToolPlan | None = None):
        deadline = Deadline(request_timeout_s)
        if drain.draining:
            return drain.refusal()
        try:
            body.check_supported()
            if body.model is not None and body.model != model_name:
                return error_response(404, f"The model '{body.model}' does not exist (this server "
                                      f"serves '{model_name}')", param="model",
                                      code="model_not_found")
            max_tokens = body.check_prompt(prompt_ids, vocab_size, max_context)
            constraint = plan.constraint() if plan is not None and plan.forces else body.constraint()
            params = [body.to_params(max_tokens, j, constraint) for j in range(body.n)]
            echo = ""
            if not chat and getattr(body, "echo", False) and tokenizer is not None:
                try:
                    echo = tokenizer_call(tokenizer.decode, prompt_ids)
                except ValueError as e:
                    raise UnsupportedField("prompt", str(e)) from None
            if (full := queue_full(engine().waiting_stats(), max_queued_requests)) is not None:
                return full
            rids, queue = engine().submit(prompt_ids, params)
        except UnsupportedField as e:
            return error_response(400, str(e), param=e.field)
        except ValueError as e:  # the engine's own checks (the request's were done above)
            return error_response(400, str(e))
        stops = body.stop_strings()
        choices = [ChoiceState(j, tokenizer, stops) for j in range(body.n)]
        tool_out = [ToolOutput(plan) if plan is not None and plan.parses else None
                    for _ in choices]
        events = choice_events(engine(), queue, choices, rids, http, deadline, drain.aborting)
        for ch in choices:
            ch.text_offset = len(echo)
        top_k = body.num_top_logprobs()
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
                "created": int(time.time()), "model": model_name}

        def usage() -> dict:
            done = sum(len(c.tokens) for c in choices)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": done,
                    "total_tokens": len(prompt_ids) + done}

        def logprobs_of(ch: ChoiceState, ids, lps, tops):
            if not body.wants_logprobs():
                return None
            if chat:
                return ch.chat_logprobs(ids, lps, tops)
            return ch.completion_logprobs(ids, lps, tops, want_top=top_k > 0)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(choice_list: list, use=None) -> str:
                c = {**meta, "object": obj, "choices": choice_list}
                if include_usage:
                    c["usage"] = use
                return f"data: {json.dumps(c)}\n\n"

            async def sse():
                try:
                    if chat:  # the first chunk of every choice carries the role
                        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None} for c in choices])
                    elif echo:
                        yield chunk([{"index": c.index, "text": echo, "logprobs": None,
                                      "finish_reason": None} for c in choices])
                    async for ch, d, reason in events:
                        lp = logprobs_of(ch, d.token_ids, d.logprobs, d.top) if d.token_ids else None
                        tools_out = tool_out[ch.index] if chat else None
                        if tools_out is not None:  # content held back around calls, calls at end
                            for k, (delta, why) in enumerate(tools_out.deltas(d.text, reason)):
                                part_lp = None if k else lp
                                if delta or why or part_lp:  # no empty chunk per held token
                                    yield chunk([{"index": ch.index, "delta": delta,
                                                  "logprobs": part_lp, "finish_reason": why}])
                            continue
                        if chat:
                            delta = {"content": d.text} if d.text else {}
                            one = {"index": ch.index, "delta": delta, "logprobs": lp,
                                   "finish_reason": reason}
                        else:
                            one = {"index": ch.index, "text": d.text, "logprobs": lp,
                                   "finish_reason": reason, "token_ids": d.token_ids}
                        yield chunk([one])
                    if include_usage:
                        yield chunk([], usage())
                    yield "data: [DONE]\n\n"
                except Disconnected:
                    return
                except Exception as e:  # noqa: BLE001 - this request only: a final error event
                    if isinstance(e, TimedOut):
                        _abort(rids, "timeout")
                    status, message, code = failure(e)
                    yield error_event(status, message, code=code)
                finally:
                    _abort(rids)

            return StreamingResponse(sse(), media_type="text/event-stream")

        try:
            async for _ in events:
                pass
            return whole_body(chat, meta, choices, tool_out, echo, logprobs_of, usage())
        except Disconnected:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - this request only: an OpenAI error body
            if isinstance(e, TimedOut):
                _abort(rids, "timeout")
            status, message, code = failure(e)
            return error_response(status, message, code=code)
        finally:
            _abort(rids)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        try:
            prompt_ids = _encode(body.prompt)
        except ValueError as e:
            return error_response(400, str(e), param="prompt")
        return await _run(http, body, prompt_ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        if not body.messages:
            return error_response(400, "messages is empty", param="messages")
        if tokenizer is None:
            return error_response(400, "this model has no tokenizer (no tokenizer.json): chat "
                                  "needs one", param="messages")
        try:
            plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                              constrained=body.constraint()[1])
            messages = [m.as_dict() for m in body.messages]
            prompt_ids = render_prompt(tokenizer, messages, plan.rendered if plan else None)
        except UnsupportedField as e:
            return error_response(400, str(e), param=e.field)
        except (ValueError, TypeError) as e:  # TypeError: `tokenizers` refusing a string
            return error_response(400, str(e), param="messages")
        except Exception as e:  # noqa: BLE001 - the tokenizer / chat template refusing them
            return error_response(400, f"these messages cannot be rendered or tokenized "
                                  f"({type(e).__name__}: {e})", param="messages")
        return await _run(http, body, prompt_ids, chat=True, plan=plan)

    return app
