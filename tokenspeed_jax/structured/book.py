"""`GrammarBook`: the live grammar matchers of one engine and the token bitmask of a step.

Host side only (numpy + llguidance). The engine registers a request's grammar when it queues it,
advances its matcher with every token the scheduler applies, asks for the bitmask of each step
that has a constrained sampling row, and drops the matcher when the request ends. A matcher that
is stopped after a token (the grammar cannot continue) ends its request ("stop").

The bitmask is `i32[R, ceil(V / 32)]`: bit `t % 32` of word `t // 32` set = token t allowed
(llguidance's layout); every bit of an unconstrained row is set (-1 words).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np


class GrammarBook:
    """Matchers by request id over one llguidance tokenizer (built on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], max_rows: int) -> None:
        self._source = (tokenizer, vocab_size, tuple(eos_token_ids))
        self._ll = None
        self.max_rows, self.words = max_rows, (vocab_size + 31) // 32
        self._matchers: dict[str, Any] = {}
        self.mask_s = 0.0  # host seconds computing bitmasks (stats)
        self.num_masked_rows = 0
        self.num_masked_steps = 0

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def tokenizer(self):
        if self._ll is None:
            from tokenspeed_jax.structured.vocab import ll_tokenizer

            self._ll = ll_tokenizer(*self._source)
        return self._ll

    def add(self, request_id: str, grammar: str) -> None:
        """Start a matcher for `request_id`; ValueError when the grammar does not build."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        self._matchers[request_id] = matcher

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def advance(self, request_id: str, token: int) -> bool:
        """Feed one applied token; True when the request must end here (the grammar is complete
        and cannot continue, or the token broke it, which the mask makes impossible)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.consume_token(int(token)):
            return True
        return matcher.is_stopped()

    def constrained_rows(
        self, request_ids: Sequence[str], sample_mask: np.ndarray, num_rows: int
    ) -> list[tuple[int, str]]:
        """(row, request id) of the step's sampling rows that have a matcher."""
        if not self._matchers:
            return []
        m = self._matchers
        flags = sample_mask[:num_rows].tolist()
        return [(i, r) for i, r in enumerate(request_ids[:num_rows]) if flags[i] and r in m]

    def bitmask(self, rows: list[tuple[int, str]]) -> np.ndarray:
        """A new `i32[R, words]` bitmask of the step for `rows` (from `constrained_rows`): a
        fresh array each step, since a CPU device may alias the host buffer it is given."""
        from llguidance.numpy import fill_next_token_bitmask

        t0 = time.perf_counter()
        mask = np.full((self.max_rows, self.words), -1, np.int32)
        for i, rid in rows:
            fill_next_token_bitmask(self._matchers[rid], mask, i)
        self.mask_s += time.perf_counter() - t0
        self.num_masked_rows += len(rows)
        self.num_masked_steps += 1
        return mask

    def stats(self) -> dict[str, float]:
        return {
            "structured_live": len(self._matchers),
            "structured_steps": self.num_masked_steps,
            "structured_rows": self.num_masked_rows,
            "structured_mask_s": self.mask_s,
        }
