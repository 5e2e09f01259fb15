"""FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (streaming via SSE), /health,
/stats, /metrics; the research routes /sleep, /wake_up, /is_sleeping, /update_weights_from_disk
(`server.research_routes`: completions get 503 while asleep).

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

The routes here only parse and hand over: the completion flow behind the two completion routes
(admission, engine submissions, streamed and whole answers) is `server.serving`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenspeed_jax.engine.replicas import aggregate_stats
from tokenspeed_jax.server.async_engine import AsyncEngine
from tokenspeed_jax.server.auth import ApiKeyMiddleware
from tokenspeed_jax.server.drain import DEFAULT_SHUTDOWN_GRACE_S, Drain
from tokenspeed_jax.server.errors import install_error_handlers
from tokenspeed_jax.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from tokenspeed_jax.server.metrics import ServerMetrics
from tokenspeed_jax.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenspeed_jax.server.research_routes import ResearchGate, add_research_routes
from tokenspeed_jax.server.serving import CompletionService
from tokenspeed_jax.server.tokenize_routes import add_tokenize_routes

log = logging.getLogger("tokenspeed_jax.server")


def describe(llm, model_name: str) -> str:
    """The one startup line: model, dtype, pages, page size, max context, buckets, backend."""
    e = llm.engines[0]
    cfg, runner = e.scheduler.config, e.runner
    return (
        f"model={model_name} dtype={getattr(llm, 'dtype', '?')} replicas={len(llm.engines)} "
        f"pages={cfg.num_pages - 1} page_size={cfg.page_size} "
        f"max_context={cfg.max_context_len} max_batch={cfg.max_batch_requests} "
        f"buckets={list(runner.buckets)} "
        f"backend={runner.backend}"
    )


def _lifespan(
    llm: Any,
    model_name: str,
    holder: dict[str, AsyncEngine],
    metrics: ServerMetrics,
    drain: Drain,
    *,
    warmup: bool,
    route: str,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: its `AsyncEngine` (stepping threads, warmup) exists only while the app
    runs, so building an app starts nothing; `holder["engine"]` is where the routes find it."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine = AsyncEngine(
            llm.engines,
            warmup=warmup,
            on_finish=metrics.observe,
            on_scheduled=metrics.observe_queue_time,
            route=route,
        )
        holder["engine"] = engine
        _app.state.engine = engine
        drain.live, drain.abort_rest = engine.num_live, engine.abort_all
        log.info("tokenspeed-jax serving: %s (warming up)", describe(llm, model_name))
        yield
        engine.shutdown()

    return lifespan


def _add_middleware(
    app: FastAPI, max_request_bytes: int | None, api_keys: Sequence[str], metrics_require_key: bool
) -> None:
    if max_request_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_keys:  # added last: outermost, so it answers before the body is read
        app.add_middleware(ApiKeyMiddleware, keys=list(api_keys), require_key_for_metrics=metrics_require_key)


def build_app(
    llm,
    model_name: str = "tiny-random",
    *,
    warmup: bool = True,
    route: str = "prefix",
    api_keys: Sequence[str] = (),
    metrics_require_key: bool = False,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    max_queued_requests: int | None = None,
    request_timeout_s: float | None = None,
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
) -> FastAPI:
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
    holder: dict[str, AsyncEngine] = {}
    metrics = ServerMetrics(lambda: holder["engine"].stats())
    drain = Drain(shutdown_grace_s)
    app = FastAPI(
        title="tokenspeed-jax",
        lifespan=_lifespan(llm, model_name, holder, metrics, drain, warmup=warmup, route=route),
    )
    app.state.drain = drain
    install_error_handlers(app)
    _add_middleware(app, max_request_bytes, api_keys, metrics_require_key)
    add_tokenize_routes(app, tokenizer, model_name, max_context, vocab_size)

    def engine() -> AsyncEngine:
        return holder["engine"]

    gate = ResearchGate()  # /sleep, /wake_up, /update_weights_from_disk (server.research_routes)
    add_research_routes(app, llm, engine, gate)
    service = CompletionService(
        engine,
        tokenizer,
        model_name,
        vocab_size,
        max_context,
        drain,
        max_queued_requests=max_queued_requests,
        request_timeout_s=request_timeout_s,
        gate=gate,
    )

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
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tokenspeed-jax",
                    "max_model_len": max_context,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await service.create_completion(body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        return await service.create_chat_completion(body, http)

    return app
