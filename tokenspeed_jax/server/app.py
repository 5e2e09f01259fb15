"""FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (streaming via SSE), /health,
/stats. Bad requests get HTTP 400 with an OpenAI-style error body; a client that disconnects
mid-stream has its request aborted (its pages come back at once)."""

from __future__ import annotations

import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenspeed_jax.server.async_engine import AsyncEngine
from tokenspeed_jax.server.protocol import ChatCompletionRequest, CompletionRequest


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": "invalid_request_error", "code": status}},
    )


def _chat_prompt(tokenizer, messages) -> str:
    msgs = [{"role": m.role, "content": m.content} for m in messages]
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is not None:
        try:
            return apply(msgs)
        except (ValueError, NotImplementedError):
            pass
    # models without a template (tiny-random): a plain, documented fallback
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs) + "<|assistant|>\n"


def build_app(llm, model_name: str = "tiny-random") -> FastAPI:
    engine = AsyncEngine(llm.engine)
    tokenizer = llm.tokenizer
    default_max = 16

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="tokenspeed-jax", lifespan=lifespan)
    app.state.engine = engine

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/stats")
    def stats():
        return engine.stats()

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "tokenspeed-jax"}],
        }

    def _encode(prompt) -> list[int]:
        if tokenizer is None and not (prompt and all(isinstance(p, int) for p in prompt)):
            raise ValueError("this model has no tokenizer (no tokenizer.json): send token ids")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if prompt and all(isinstance(p, int) for p in prompt):
            return list(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return tokenizer.encode(prompt[0])
        raise ValueError("prompt must be a string, a list of token ids, or a list of one string")

    async def _run(http: Request, body, prompt_ids: list[int], chat: bool):
        try:
            max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
            body.max_tokens = max_tokens
            params = body.to_params(default_max)
            rid, queue = engine.submit(prompt_ids, params)
        except ValueError as e:
            return _error(400, str(e))
        stops = body.stop_strings()
        created = int(time.time())
        oid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        kind = "chat.completion" if chat else "text_completion"

        async def events():
            tokens: list[int] = []
            text = ""
            reason = None
            logprobs = None
            while reason is None:
                kind_, item = await queue.get()
                if kind_ == "error":
                    raise RuntimeError(item)
                if kind_ == "delta":
                    tokens += item
                    new_text = tokenizer.decode(tokens) if tokenizer is not None else ""
                    hit = min((new_text.find(s) for s in stops if s in new_text), default=-1)
                    if hit >= 0:
                        engine.abort(rid)
                        new_text, reason = new_text[:hit], "stop"
                    else:
                        # hold back a trailing partial UTF-8 character until it completes
                        new_text = new_text.rstrip("\ufffd")
                    delta = new_text[len(text):] if new_text.startswith(text) else ""
                    text = text + delta
                    if delta:
                        yield delta, None, None
                else:
                    reason = item.finish_reason
                    logprobs = item.logprobs
                    final = tokenizer.decode(tokens) if tokenizer is not None else ""
                    if final.startswith(text) and len(final) > len(text):
                        yield final[len(text):], None, None
            yield "", reason, (tokens, logprobs)

        if body.stream:

            async def sse():
                try:
                    async for delta, reason, _ in events():
                        if await http.is_disconnected():
                            engine.abort(rid)
                            return
                        choice = (
                            {
                                "index": 0,
                                "delta": {"content": delta} if delta else {},
                                "finish_reason": reason,
                            }
                            if chat
                            else {"index": 0, "text": delta, "finish_reason": reason}
                        )
                        chunk = {
                            "id": oid,
                            "object": f"{kind}.chunk" if chat else kind,
                            "created": created,
                            "model": model_name,
                            "choices": [choice],
                        }
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    engine.abort(rid)  # no-op once finished; frees pages on disconnect

            return StreamingResponse(sse(), media_type="text/event-stream")

        text, reason, final = "", None, ([], None)
        try:
            async for delta, r, f in events():
                text += delta
                if r is not None:
                    reason, final = r, f
        except RuntimeError as e:
            return _error(500, str(e))
        tokens, logprobs = final
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt_ids) + len(tokens),
        }
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        else:
            echo = (tokenizer.decode(prompt_ids)
                    if getattr(body, "echo", False) and tokenizer is not None else "")
            choice = {"index": 0, "text": echo + text, "finish_reason": reason, "token_ids": tokens}
            if logprobs is not None:
                choice["logprobs"] = {"token_logprobs": logprobs}
        return {
            "id": oid,
            "object": kind,
            "created": created,
            "model": model_name,
            "choices": [choice],
            "usage": usage,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        try:
            prompt_ids = _encode(body.prompt)
        except ValueError as e:
            return _error(400, str(e))
        return await _run(http, body, prompt_ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        if not body.messages:
            return _error(400, "messages is empty")
        if tokenizer is None:
            return _error(400, "this model has no tokenizer (no tokenizer.json): chat needs one")
        return await _run(http, body, tokenizer.encode(_chat_prompt(tokenizer, body.messages)), chat=True)

    return app
