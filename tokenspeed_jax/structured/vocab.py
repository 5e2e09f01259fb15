"""Our tokenizers as llguidance tokenizers (what a matcher needs to turn grammar bytes into
allowed token ids). Built once per engine: ~0.5 s for a 49k BPE vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class _ByteVocab:
    """The built-in byte tokenizer in llguidance's `TokenizerWrapper` shape: ids 0..255 are
    bytes; the specials after them are named tokens that text never produces."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        from tokenspeed_jax.models.byte_tokenizer import SPECIAL_IDS

        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i in SPECIAL_IDS if i < vocab_size]
        names = {i: f"<|special_{i}|>".encode() for i in self.special_token_ids}
        self.tokens = [
            bytes([i]) if i < 256 else names.get(i, f"<|unused_{i}|>".encode()) for i in range(vocab_size)
        ]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
    """The llguidance `LLTokenizer` of `tokenizer` over the model's `vocab_size` logits (ids past
    the tokenizer's own vocabulary are never allowed). ValueError for a tokenizer it cannot
    wrap."""
    import llguidance

    from tokenspeed_jax.models.byte_tokenizer import ByteTokenizer

    eos = list(eos_token_ids) or None
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)), n_vocab=vocab_size, eos_token=eos
        )
    backend = getattr(tokenizer, "backend", None)  # HFTokenizer: a `tokenizers.Tokenizer`
    if backend is None or not hasattr(backend, "to_str"):
        raise ValueError(
            f"structured outputs need a byte or Hugging Face tokenizer, got {type(tokenizer).__name__}"
        )
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
