"""`POST /tokenize` and `POST /detokenize` in vLLM's request and response shapes: its own
benchmark client (`vllm bench serve`) and many tools call them to count and inspect tokens.

tokenize: `{"model"?, "prompt": str, "add_special_tokens"?: bool}` or `{"model"?, "messages":
[...], "add_generation_prompt"?: bool}` (rendered exactly as /v1/chat/completions renders them)
-> `{"count", "max_model_len", "tokens"}`. detokenize: `{"model"?, "tokens": [...]}` ->
`{"prompt"}`. Bad input (ids outside the vocabulary, text that is not valid Unicode) is a 400
naming the field.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from tokenspeed_jax.engine.chat_template import render_chat
from tokenspeed_jax.models.byte_tokenizer import ByteTokenizer
from tokenspeed_jax.server.errors import UnsupportedField, error_response, model_not_found
from tokenspeed_jax.server.protocol import ChatMessage, Text


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: Text | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`text` encoded with or without the tokenizer's specials (the byte tokenizer calls its
    one special, BOS, `add_bos`)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text, add_bos=add_special_tokens)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def add_tokenize_routes(
    app: FastAPI, tokenizer: Any, model_name: str, max_context: int, vocab_size: int
) -> None:
    def refuse(model: str | None):
        if tokenizer is None:
            return error_response(400, "this model has no tokenizer (no tokenizer.json)")
        if model is not None and model != model_name:
            return model_not_found(model, model_name)
        return None

    @app.post("/tokenize")
    def tokenize(body: TokenizeRequest):
        if (bad := refuse(body.model)) is not None:
            return bad
        if (body.prompt is None) == (body.messages is None):
            return error_response(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
        field = "prompt" if body.prompt is not None else "messages"
        try:
            if body.prompt is not None:
                ids = encode_text(tokenizer, body.prompt, body.add_special_tokens)
            else:
                ids = render_chat(
                    tokenizer,
                    [m.as_dict() for m in body.messages or ()],
                    add_generation_prompt=body.add_generation_prompt,
                )
        except UnsupportedField as e:
            return error_response(400, str(e), param=e.field)
        except (ValueError, TypeError) as e:  # incl. UnicodeEncodeError (a lone surrogate)
            return error_response(400, f"cannot tokenize {field}: {e}", param=field)
        ids = [int(t) for t in ids]
        return {"count": len(ids), "max_model_len": max_context, "tokens": ids}

    @app.post("/detokenize")
    def detokenize(body: DetokenizeRequest):
        if (bad := refuse(body.model)) is not None:
            return bad
        outside = [t for t in body.tokens if not 0 <= t < vocab_size]
        if outside:
            return error_response(
                400, f"token id {outside[0]} outside the vocabulary [0, {vocab_size})", param="tokens"
            )
        return {"prompt": tokenizer.decode(body.tokens)}
