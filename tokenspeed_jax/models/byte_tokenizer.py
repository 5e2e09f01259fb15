"""Byte-level tokenizer of the built-in model: ids 0..255 are UTF-8 bytes, then a few specials."""

from __future__ import annotations

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
UNK_ID = 259
VOCAB_SIZE = 260
SPECIAL_IDS = (BOS_ID, EOS_ID, PAD_ID, UNK_ID)


class ByteTokenizer:
    """encode(str) -> UTF-8 byte ids (optionally BOS first); decode skips special ids."""

    vocab_size = VOCAB_SIZE
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID

    def __init__(self, add_bos: bool = True):
        self.add_bos = add_bos

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if (self.add_bos if add_bos is None else add_bos) else ids

    def decode(self, ids: list[int]) -> str:
        """Invalid UTF-8 (e.g. a token cut mid-character) decodes with U+FFFD replacement."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
