"""Per-request host state and the finished-request output record."""

from __future__ import annotations

import dataclasses
import enum
import zlib
from typing import Any

from scheduler.block_table import BlockTable
from scheduler.hashing import PrefixHasher


class Status(enum.Enum):
    WAITING = "waiting"  # never admitted, or retracted and waiting to resume
    RUNNING = "running"  # holds pages and a device slot
    # overlapped scheduling: its last token (a length limit) is in flight; pages and slot are
    # already released, `update` only appends that token and finishes it
    FINISHING = "finishing"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestOutput:
    """What `Scheduler.update` returns for a finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids (a stop token, if any, is the last one)
    finish_reason: str  # "length" | "stop" | "abort"
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_retractions: int = 0


class Request:
    """A request's host state. `tokens` = prompt + the generated ids known on the host;
    `num_computed` of them have KV.

    Overlapped scheduling (one step in flight while the next is planned) adds two counters:
    `num_inflight` tokens are scheduled in steps whose results have not come back yet (their KV
    is being written), and `num_pending` sampled tokens exist only on the device so far (their
    ids arrive with `update`). The request's virtual stream is `tokens` + `num_pending`
    placeholders. Each step schedules virtual positions `[num_scheduled, num_scheduled + n)`;
    the row samples iff that reaches the end of the virtual stream. A decode is n = 1 with one
    token (possibly a placeholder) left. In the synchronous loop both counters are 0 whenever
    `schedule()` runs. `epoch` counts releases (retraction, abort, finish): a step row records
    it so `update` can tell that the pages it wrote were given back meanwhile. A retracted
    request keeps `tokens` (its output folded in) and resumes with a fresh prefix match.
    """

    __slots__ = ("request_id", "prompt_len", "tokens", "max_new_tokens", "stop_token_ids",
                 "temperature", "top_p", "top_k", "seed", "prompt_logprobs", "arrival",
                 "hasher", "status", "tables", "slot", "num_computed", "reserved",
                 "prefill_done", "num_decode_rows", "needs_refresh", "num_cached_tokens",
                 "num_retractions", "finish_reason", "published_base_pages", "admitted_once",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                 "top_logprobs", "has_penalties", "needs_extras",
                 "num_inflight", "num_pending", "epoch")

    def __init__(self, request_id: str, prompt: list[int], max_new_tokens: int, *,
                 stop_token_ids: frozenset[int], temperature: float, top_p: float, top_k: int,
                 seed: int, prompt_logprobs: bool, arrival: int, hash_base: int,
                 cache_salt: bytes) -> None:
        self.request_id = request_id
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.seed = seed
        self.prompt_logprobs = prompt_logprobs
        self.arrival = arrival
        self.hasher = PrefixHasher(hash_base, cache_salt)
        self.hasher.extend(self.tokens)
        self.status = Status.WAITING
        self.tables: list[BlockTable] | None = None
        self.slot = -1
        self.num_computed = 0
        self.reserved = 0  # pages promised to this request's next acquire
        self.prefill_done = False
        self.num_decode_rows = 0
        self.needs_refresh = True
        self.num_cached_tokens = 0
        self.num_retractions = 0
        self.finish_reason: str | None = None
        self.published_base_pages = 0
        self.admitted_once = False
        # penalties / logit_bias / top-k logprobs (StepOps per-request sampling fields)
        self.presence_penalty = 0.0
        self.frequency_penalty = 0.0
        self.repetition_penalty = 1.0
        self.logit_bias: tuple[tuple[int, float], ...] = ()
        self.top_logprobs = 0
        # the device must count this request's tokens (such requests skip the prefix cache so
        # that every token they hold passes through a step; see tokenspeed_jax/runtime/sampling.py)
        self.has_penalties = False
        self.needs_extras = False  # any non-padding penalty / logit_bias / top_logprobs field
        self.num_inflight = 0  # tokens scheduled in steps not yet fed back by `update`
        self.num_pending = 0  # sampled tokens still on the device (placeholders on the host)
        self.epoch = 0  # bumped by every release; a step row whose epoch differs is stale

    @classmethod
    def from_options(cls, request_id: str, prompt: list[int], max_new_tokens: int, options: dict[str, Any],
                     *, arrival: int, hash_base: int) -> Request:
        """Validate the per-request options (ValueError naming the option) and build the request.

        Options: stop_token_ids, temperature (0 = greedy), top_p, top_k, seed (None = derived
        from the request id, so reruns reproduce), prompt_logprobs, cache_salt (str | bytes),
        presence_penalty, frequency_penalty (floats, 0 = off), repetition_penalty (> 0, 1 = off),
        logit_bias ({token id: bias}), top_logprobs (int in [0, 20])."""
        unknown = set(options) - {"stop_token_ids", "temperature", "top_p", "top_k", "seed",
                                  "prompt_logprobs", "cache_salt", *_EXTRA_OPTIONS}
        if unknown:
            raise ValueError(f"request {request_id!r}: unknown options {sorted(unknown)}")
        temperature = float(options.get("temperature", 0.0))
        top_p = float(options.get("top_p", 1.0))
        top_k = int(options.get("top_k", -1))
        if not temperature >= 0.0:
            raise ValueError(f"request {request_id!r}: temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"request {request_id!r}: top_p must be in (0, 1], got {top_p}")
        if top_k == 0 or top_k < -1:
            raise ValueError(f"request {request_id!r}: top_k must be -1 or >= 1, got {top_k}")
        seed = options.get("seed")
        if seed is None:
            seed = zlib.crc32(request_id.encode())
        salt = options.get("cache_salt") or b""
        if isinstance(salt, str):
            salt = salt.encode()
        req = cls(request_id, prompt, max_new_tokens,
                  stop_token_ids=frozenset(int(t) for t in options.get("stop_token_ids", ())),
                  temperature=temperature, top_p=top_p, top_k=top_k, seed=int(seed) & 0xFFFFFFFF,
                  prompt_logprobs=bool(options.get("prompt_logprobs", False)), arrival=arrival,
                  hash_base=hash_base, cache_salt=salt)
        _set_extra_options(req, options)
        return req

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_scheduled(self) -> int:
        """Tokens whose KV is computed or being computed by a step in flight."""
        return self.num_computed + self.num_inflight

    @property
    def remaining(self) -> int:
        """Virtual tokens (known + pending) not yet scheduled."""
        return len(self.tokens) + self.num_pending - self.num_scheduled

    def finishes_by_length(self, max_context_len: int) -> bool:
        """True when the pending tokens will certainly end the request ("length"): then it is
        not planned again (a stop token can never be predicted, a length limit can)."""
        total = len(self.tokens) + self.num_pending
        return total - self.prompt_len >= self.max_new_tokens or total >= max_context_len

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.tokens[:self.prompt_len],
                             self.tokens[self.prompt_len:], self.finish_reason or "abort",
                             self.num_cached_tokens, self.num_retractions)


_EXTRA_OPTIONS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                  "top_logprobs", "has_penalties", "needs_extras")


def _set_extra_options(req: Request, options: dict[str, Any]) -> None:
    """Validate and set the penalty / logit_bias / top_logprobs options (ValueError naming them)."""
    rid = req.request_id
    for name in ("presence_penalty", "frequency_penalty"):
        value = float(options.get(name) or 0.0)
        if not -2.0 <= value <= 2.0:
            raise ValueError(f"request {rid!r}: {name} must be in [-2, 2], got {value}")
        setattr(req, name, value)
    rep = float(options.get("repetition_penalty") or 1.0)
    if not 0.0 < rep <= 1e4:
        raise ValueError(f"request {rid!r}: repetition_penalty must be > 0, got {rep}")
    req.repetition_penalty = rep
    bias = options.get("logit_bias") or {}
    items = tuple(sorted((int(t), float(b)) for t, b in dict(bias).items()))
    if any(t < 0 for t, _ in items) or any(not -100.0 <= b <= 100.0 for _, b in items):
        raise ValueError(f"request {rid!r}: logit_bias needs token ids >= 0 and biases in "
                         f"[-100, 100], got {dict(items)}")
    req.logit_bias = items
    top = int(options.get("top_logprobs") or 0)
    if not 0 <= top <= 20:
        raise ValueError(f"request {rid!r}: top_logprobs must be in [0, 20], got {top}")
    req.top_logprobs = top
    req.has_penalties = (req.presence_penalty != 0.0 or req.frequency_penalty != 0.0
                         or req.repetition_penalty != 1.0)
    req.needs_extras = req.has_penalties or bool(items) or top > 0
