"""Chained prefix hashes over base pages (DESIGN.md §5).

hash_i = H(hash_{i-1} || token ids of base page i || extra keys). Only full pages are hashed,
each exactly once, incrementally as tokens arrive. A group page of `k` base pages is keyed by
(group index, hash of its last base page): the chain already covers everything before it.
"""

from __future__ import annotations

import hashlib

import numpy as np

_DIGEST = 16


def root_hash(extra_keys: bytes = b"") -> bytes:
    """Chain seed; a cache salt (or any extra key) changes every hash of the request."""
    return hashlib.blake2b(b"tokenspeed-jax/root\0" + extra_keys, digest_size=_DIGEST).digest()


def page_hash(prev: bytes, tokens: list[int] | np.ndarray, extra_keys: bytes = b"") -> bytes:
    h = hashlib.blake2b(prev, digest_size=_DIGEST)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(extra_keys)
    return h.digest()


class PrefixHasher:
    """Incremental chained hashes of one token stream, one per full base page."""

    __slots__ = ("base", "extra_keys", "hashes", "_root")

    def __init__(self, base: int, extra_keys: bytes = b"") -> None:
        self.base = base
        self.extra_keys = extra_keys
        self._root = root_hash(extra_keys)
        self.hashes: list[bytes] = []

    def extend(self, tokens: list[int]) -> None:
        """Hash every newly completed base page of `tokens` (the whole stream so far)."""
        b = self.base
        done = len(self.hashes)
        full = len(tokens) // b
        prev = self.hashes[-1] if done else self._root
        for i in range(done, full):
            prev = page_hash(prev, tokens[i * b : (i + 1) * b], self.extra_keys)
            self.hashes.append(prev)
