"""A `tokenizers.Tokenizer` (wrapped in `HFTokenizer`) built from GGUF `tokenizer.*` metadata.

Byte-level BPE files (`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3, Qwen, ...) carry the
vocabulary (already spelled in the GPT-2 byte alphabet), the merges ("a b" strings), token types
(3 = control -> special added token, 4 = user-defined -> plain added token), bos/eos/pad ids,
`add_bos_token` and the chat template. The pre-tokenizer is not stored, only its llama.cpp name
(`tokenizer.ggml.pre`); `PRE_TOKENIZERS` maps the names we know onto `tokenizers` components:
* "smollm": single digits, then the GPT-2 split (how SmolLM's own tokenizer.json splits);
* "gpt2" / "default" / missing: the GPT-2 split;
* "llama-bpe" / "llama3" / "llama-v3": the Llama 3 split regex (digits in runs of <= 3).
An unknown name falls back to the GPT-2 split with a warning. Sentencepiece files
(`tokenizer.ggml.model == "llama"`) are not built yet: the loader returns no tokenizer (token-id
prompts still work) and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenspeed_jax.hf.tokenizer import HFTokenizer

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(name: str | None):
    from tokenizers import Regex, pre_tokenizers

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in (None, "default", "gpt2"):
        return gpt2
    if name == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if name in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    log.warning("GGUF pre-tokenizer %r is not mapped; using the GPT-2 split", name)
    return gpt2


PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "llama-v3")


def byte_level_bpe(meta: dict[str, Any]):
    """The `tokenizers.Tokenizer` of a byte-level BPE GGUF (vocab, merges, added tokens, BOS)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_from_gguf(meta: dict[str, Any], model_eos: Sequence[int] = ()) -> HFTokenizer | None:
    """`HFTokenizer` of a GGUF's metadata, or None (with a warning) when the file has no
    tokenizer or a kind we do not build yet."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        return None
    if kind != "gpt2":
        log.warning(
            "GGUF tokenizer kind %r is not supported yet (only byte-level BPE 'gpt2'): "
            "the model serves token-id prompts only",
            kind,
        )
        return None
    tokens = meta["tokenizer.ggml.tokens"]

    def text(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    config = {"bos_token": text("bos_token_id"), "eos_token": text("eos_token_id"),
              "pad_token": text("padding_token_id"),
              "chat_template": meta.get("tokenizer.chat_template")}  # fmt: skip
    return HFTokenizer(byte_level_bpe(meta), config=config, model_eos=model_eos)
