"""Per-request records of the engine: the accepted prompt, the live request's track (what
`Engine.stream` and its output report), and routing one step's results to the tracks."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np

from scheduler import StepOps
from tokenspeed_jax.outputs import RequestMetrics
from tokenspeed_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenspeed_jax.runtime.step_outputs import StepResult
    from tokenspeed_jax.structured.book import GrammarBook


@dataclasses.dataclass(frozen=True)
class CheckedPrompt:
    """A request that `Engine.validate` accepted: the prompt as ints, every id (prompt, stop,
    logit_bias) inside the vocabulary, prompt + max_tokens within max_context_len.

    `Engine.add_request(checked, checked.params)` queues it without the engine checking it again
    (only the scheduler's own `add_request` guard runs). Valid on every engine with the same
    vocabulary and max_context_len, i.e. on every replica of one `LLM`."""

    ids: list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class StreamState:
    """What a live request has generated so far, from generated token `start` on
    (`Engine.stream`): a streaming consumer that has sent `start` tokens asks for the rest.

    One step may add several tokens (a prefill that ends a prompt adds one, decode one per step;
    speculative decoding would add several), so consumers take whatever is new."""

    start: int
    token_ids: list[int]  # generated ids [start:]
    logprobs: list[float]  # their logprobs ([] unless the request asked for logprobs)
    top_logprobs: list[list[tuple[int, float]]]  # their top-k (id, logprob) lists ([] unless asked)
    num_generated: int  # generated tokens in all (start + len(token_ids) when start <= it)


class Track:
    """Engine-side state of one live request: everything `stream` and its output report."""

    __slots__ = ("params", "metrics", "token_ids", "logprobs", "prompt_logprobs", "prompt", "top")

    def __init__(self, prompt: list[int], params: SamplingParams) -> None:
        self.prompt = prompt
        self.params = params
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.token_ids: list[int] = []  # generated ids: one per applied sampling row
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []  # top-k (id, logprob) per generated token
        self.prompt_logprobs: list[float | None] | None = (
            [None] * len(prompt) if params.prompt_logprobs else None
        )

    @property
    def cost(self) -> int:
        """Outstanding tokens: prompt + max_tokens (the "load" routing policy's unit)."""
        return len(self.prompt) + self.params.max_tokens


def route_results(
    tracks: dict[str, Track],
    ops: StepOps,
    result: StepResult,
    now: float,
    applied: list[bool],
    spec_tokens: dict[int, list[int]],
    book: GrammarBook | None,
) -> tuple[list[str], int]:
    """Sampled ids and logprobs of the rows whose results the scheduler applied, to their
    requests' tracks (a row planned behind a request that finished or was aborted meanwhile
    produced nothing for anyone); the same rows append to the scheduler's `Request.tokens`.
    Constrained requests' matchers (`book`) advance. Returns (the ids whose grammar is
    complete, tokens generated). A speculative row appends every token it produced
    (`spec_tokens`; no logprobs)."""
    ended: list[str] = []
    # plain Python over the rows (numpy scalar indexing per row costs more than the work)
    rids = ops.request_ids
    n = ops.num_seqs
    mask = ops.sample_mask[:n].tolist()
    sampled = np.asarray(result.sampled)[:n].tolist()
    logprobs: np.ndarray | None = None  # read only once a row asks for logprobs
    top_ids, top_lp = result.top_ids, result.top_logprobs
    count = 0
    for i in range(n):
        if not (mask[i] and applied[i]):
            continue
        got = spec_tokens.get(i) if spec_tokens else None
        count += 1 if got is None else len(got)
        track = tracks.get(rids[i])
        if track is None:
            continue
        metrics = track.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if got is not None:  # a speculative row: never constrained, no logprobs
            track.token_ids.extend(got)
            continue
        track.token_ids.append(sampled[i])
        if book is not None and book.advance(rids[i], sampled[i]):
            ended.append(rids[i])
        params = track.params
        k = params.top_logprobs
        if params.logprobs or k:
            if logprobs is None:
                logprobs = np.asarray(result.logprobs)
            track.logprobs.append(float(logprobs[i]))
            if k and top_ids is not None and top_lp is not None:
                track.top.append(list(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist())))
    targets = np.flatnonzero(ops.prompt_targets[: ops.num_tokens] >= 0)
    if len(targets):
        plp = np.asarray(result.prompt_logprobs)
        for t in targets:
            row = int(ops.token_rows[t])
            if not applied[row]:
                continue
            track = tracks.get(ops.request_ids[row])
            if track is not None and track.prompt_logprobs is not None:
                track.prompt_logprobs[int(ops.positions[t]) + 1] = float(plp[t])
    return ended, count
