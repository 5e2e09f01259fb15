"""`Engine`: the host loop `schedule -> device step -> update`, plus per-request bookkeeping.

The scheduler decides everything; the runner applies StepOps on the device and returns sampled
ids and logprobs; the engine validates input, routes logprobs to requests, times them, and turns
finished scheduler outputs into `CompletionOutput`s. One engine = one model + one cache.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from scheduler import Scheduler, SchedulerConfig, StepOps
from tokenspeed_jax.outputs import CompletionOutput, RequestMetrics
from tokenspeed_jax.sampling_params import SamplingParams


class _Track:
    """Engine-side state of one live request."""

    __slots__ = ("params", "metrics", "logprobs", "prompt_logprobs", "prompt", "top")

    def __init__(self, prompt: list[int], params: SamplingParams) -> None:
        self.prompt = prompt
        self.params = params
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []  # top-k (id, logprob) per generated token
        self.prompt_logprobs: list[float | None] | None = (
            [None] * len(prompt) if params.prompt_logprobs else None)


class Engine:
    """Continuous-batching engine over one `Scheduler` and one model runner.

    runner: an object with `step(ops: StepOps) -> result` where result has numpy fields
    `sampled` i32[R], `logprobs` f32[R] and `prompt_logprobs` f32[T] (NaN where none).
    """

    def __init__(self, scheduler_config: SchedulerConfig, runner, *, vocab_size: int,
                 eos_token_ids: tuple[int, ...] = (), tokenizer=None) -> None:
        self.scheduler = Scheduler(scheduler_config)
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self._tracks: dict[str, _Track] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0
        # The engine is single-threaded by design; a second concurrent stepper (e.g. calling
        # LLM.generate while a server thread drives the same engine) would reuse donated device
        # buffers, so it is refused loudly instead.
        self._stepping = threading.Lock()

    # ------------------------------------------------------------------ requests
    def validate(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """Check one request without queueing it; returns the prompt as a list of ints."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ValueError(f"prompt must be a list of token ids, got {prompt!r:.80}") from None
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        cfg = self.scheduler.config
        if len(ids) + params.max_tokens > cfg.max_context_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_context_len {cfg.max_context_len}")
        return ids

    def add_request(self, prompt: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request; raises ValueError (and queues nothing) on bad input."""
        ids = self.validate(prompt, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.eos_token_ids)
        self.scheduler.add_request(
            rid, ids, params.max_tokens, stop_token_ids=sorted(stops),
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            seed=params.seed, prompt_logprobs=params.prompt_logprobs,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias,
            top_logprobs=params.top_logprobs)
        self._tracks[rid] = _Track(ids, params)
        return rid

    def abort(self, request_id: str) -> CompletionOutput | None:
        req = self.scheduler.get_request(request_id)
        track = self._tracks.pop(request_id, None)
        if req is None or track is None:
            return None
        generated = req.tokens[req.prompt_len:]
        self.scheduler.abort(request_id)
        track.metrics.finish_time = time.perf_counter()
        return self._output(request_id, track, generated, "abort")

    def logprobs_so_far(self, request_id: str) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """(token logprobs, top-k lists) of a live request's generated tokens so far (empty
        lists when it did not ask for them or is unknown); the server streams them."""
        track = self._tracks.get(request_id)
        return ([], []) if track is None else (track.logprobs, track.top)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[CompletionOutput]:
        """One scheduler step on the device. Returns the requests that finished in it."""
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("Engine.step called concurrently from two threads")
        try:
            return self._step()
        finally:
            self._stepping.release()

    def _step(self) -> list[CompletionOutput]:
        ops = self.scheduler.schedule()
        if ops.num_reqs == 0:
            if self.scheduler.has_unfinished():
                # nothing runs and the queue head cannot be admitted: no later step can differ,
                # so fail loudly instead of spinning (add_request's fit check should prevent it)
                raise RuntimeError(f"scheduler made no progress with waiting requests: "
                                   f"{self.scheduler.stats()}")
            return []
        result = self.runner.step(ops)  # the runner logs clamped rows by request id
        now = time.perf_counter()
        self._route_logprobs(ops, result, now)
        finished = self.scheduler.update(ops, result.sampled)
        self.num_steps += 1
        self.num_prefill_tokens += int(ops.num_tokens - ops.sample_mask[:ops.num_reqs].sum())
        outs = []
        for fin in finished:
            track = self._tracks.pop(fin.request_id)
            track.metrics.finish_time = now
            track.metrics.num_cached_tokens = fin.num_cached_tokens
            track.metrics.num_retractions = fin.num_retractions
            outs.append(self._output(fin.request_id, track, fin.token_ids, fin.finish_reason))
        return outs

    def _route_logprobs(self, ops: StepOps, result, now: float) -> None:
        sampled_rows = np.flatnonzero(ops.sample_mask[:ops.num_reqs])
        self.num_generated_tokens += len(sampled_rows)
        logprobs = np.asarray(result.logprobs)
        top_ids = getattr(result, "top_ids", None)
        top_lp = getattr(result, "top_logprobs", None)
        for i in sampled_rows:
            track = self._tracks.get(ops.request_ids[i])
            if track is None:
                continue
            if track.metrics.first_token_time is None:
                track.metrics.first_token_time = now
            if track.params.logprobs or track.params.top_logprobs:
                track.logprobs.append(float(logprobs[i]))
            k = track.params.top_logprobs
            if k and top_ids is not None:
                track.top.append(list(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist())))
        targets = np.flatnonzero(ops.prompt_targets[:ops.num_tokens] >= 0)
        if len(targets):
            plp = np.asarray(result.prompt_logprobs)
            for t in targets:
                row = int(ops.token_rows[t])
                track = self._tracks.get(ops.request_ids[row])
                if track is not None and track.prompt_logprobs is not None:
                    track.prompt_logprobs[int(ops.positions[t]) + 1] = float(plp[t])

    def _output(self, rid: str, track: _Track, token_ids: list[int],
                reason: str) -> CompletionOutput:
        # generated tokens sampled before a retraction keep their logprobs; trim to what exists
        text = self.tokenizer.decode(token_ids) if self.tokenizer is not None else None
        return CompletionOutput(
            request_id=rid, prompt_token_ids=list(track.prompt), token_ids=list(token_ids),
            finish_reason=reason, text=text,
            logprobs=(track.logprobs[:len(token_ids)]
                      if track.params.logprobs or track.params.top_logprobs else None),
            prompt_logprobs=track.prompt_logprobs, metrics=track.metrics,
            top_logprobs=track.top[:len(token_ids)] if track.params.top_logprobs else None)

    def warmup(self, max_kv_len: int | None = None) -> int:
        """Compile the runner's shape keys now (`ModelRunner.warmup`: every (token, kv) bucket
        pair, or those with kv buckets up to `max_kv_len`); returns how many were compiled."""
        if max_kv_len is None:
            return self.runner.warmup(self.scheduler.padding_ops())
        return self.runner.warmup(self.scheduler.padding_ops(), max_kv_len=max_kv_len)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        out = self.scheduler.stats()
        out["num_engine_steps"] = self.num_steps
        out["num_generated_tokens"] = self.num_generated_tokens
        if hasattr(self.runner, "num_compiles"):
            out["num_compiles"] = self.runner.num_compiles
        return out
