"""Chat messages -> prompt ids, one way for every caller (the server's chat route, the chat REPL,
the chat-templated workload). No jax: the workload drivers import it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
) -> list[int]:
    """The prompt ids of `messages` ([{"role": ..., "content": ...}, ...]).

    A tokenizer with a chat template (`tokenizer.chat_template` set, e.g. `HFTokenizer`) renders
    it and encodes the text with add_special_tokens=False: the template writes BOS itself, so the
    tokenizer must not add another. Without one (the built-in byte tokenizer), a plain fallback
    "<|role|>\\ncontent\\n" per message (then "<|assistant|>\\n" when add_generation_prompt) is
    encoded with the tokenizer's defaults (BOS added, as for any plain text)."""
    if getattr(tokenizer, "chat_template", None) is not None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return list(tokenizer.encode(text + ("<|assistant|>\n" if add_generation_prompt else "")))
