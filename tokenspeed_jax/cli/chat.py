"""`tokenspeed-jax chat`: an interactive REPL over the model's chat template, streaming tokens.

Each user line is appended to the conversation, the whole conversation is re-rendered through
the chat template (so earlier turns are prefix-cache hits) and generated on the LLM's engine one
step at a time; the reply is printed as it grows (`Engine.stream`). `/reset` starts a new
conversation, `/exit` (or end of input) quits. Prompts come from `engine.chat_template.render_chat`
(the server's chat route renders the same way; models without a chat template get its plain
"<|role|>" fallback).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from tokenspeed_jax.engine.chat_template import render_chat
from tokenspeed_jax.sampling_params import SamplingParams


def stream_reply(llm, prompt: list[int], params: SamplingParams, out: TextIO) -> list[int]:
    """Generates on `llm.engine` step by step, writing the decoded text as it grows.

    Returns the generated ids. Text is written only up to the last complete character (a token
    may end inside a UTF-8 sequence; the replacement char waits for the next token)."""
    engine, tok = llm.engine, llm.tokenizer
    rid = engine.add_request(prompt, params)
    shown = ""
    ids: list[int] = []
    final = None
    while final is None:
        for done in engine.step():
            if done.request_id == rid:
                final = done
        if final is not None:
            ids = list(final.token_ids)
        elif (state := engine.stream(rid, len(ids))) is not None:
            ids += state.token_ids
        text = tok.decode(ids)
        if final is None:
            text = text.rstrip("\ufffd")
        if text.startswith(shown) and len(text) > len(shown):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    out.write("\n")
    return list(final.token_ids)


def chat_repl(llm, *, system: str | None = None, max_tokens: int = 256, temperature: float = 0.7,
              top_p: float = 0.9, input_fn: Callable[[str], str] = input,
              out: TextIO = sys.stdout) -> list[dict]:  # fmt: skip
    """Runs the REPL until `/exit` or end of input; returns the last conversation's messages."""
    if llm.tokenizer is None:
        raise ValueError("chat needs a model with a tokenizer")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p)
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    while True:
        try:
            line = input_fn("> ").strip()
        except EOFError:
            break
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(base)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = stream_reply(llm, render_chat(llm.tokenizer, messages), params, out)
        except ValueError as e:  # e.g. the conversation outgrew max_context_len
            messages.pop()
            out.write(f"[error: {e}; /reset starts a new conversation]\n")
            continue
        messages.append({"role": "assistant", "content": llm.tokenizer.decode(ids).strip()})
    return messages
