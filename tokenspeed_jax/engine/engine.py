"""`Engine`: the host loop `schedule -> device step -> update`, plus per-request bookkeeping.

The scheduler decides everything; the runner applies StepOps on the device and returns sampled
ids and logprobs; the engine validates input, routes sampled ids and logprobs to requests (what
`stream` shows of a live request), times them, and turns finished scheduler outputs into
`CompletionOutput`s. One engine = one model + one cache.

Two loops (`async_scheduling`):
  - synchronous (the reference): schedule N -> dispatch N -> wait for N -> update N;
  - overlapped: schedule N+1 -> dispatch N+1 (queued behind N on the device) -> wait for N ->
    update N. The host plans while the device computes; decode inputs sampled by step N reach
    step N+1 on the device (`StepOps.token_from_prev`), and the scheduler's plan-ahead rules
    keep pages, finishes and aborts exact (scheduler/scheduler.py).
`StepClock` (stats) shows the overlap: host, wait and critical-path time per step.

Structured outputs (`SamplingParams.structured_outputs`): the engine keeps one grammar matcher
per constrained request (`structured.GrammarBook`), advances it with every token the scheduler
applies, and sends the step's bitmask with the StepOps. A matcher needs its request's previous
token before the next mask, so the overlapped loop waits for the step in flight first when (and
only when) the next step samples a constrained request that has a token in that step. A grammar
that is complete ends its request ("stop") at once, without an EOS.

Speculative decoding (`SchedulerConfig.speculative`): a row proposes drafts from its own tokens,
so it needs its newest token on the host; such an engine runs the synchronous loop (planning
step N+1 needs step N's accepted count). Requests that ask for logprobs or a grammar do not
speculate (their per-token work is not done per draft).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from scheduler import Scheduler, SchedulerConfig, StepOps
from tokenspeed_jax.engine.runner_protocol import Runner
from tokenspeed_jax.engine.step_clock import StepClock
from tokenspeed_jax.engine.tracks import CheckedPrompt, StreamState, Track, route_results
from tokenspeed_jax.outputs import CompletionOutput
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.structured.book import GrammarBook

if TYPE_CHECKING:  # the runner module imports jax; the engine itself does not need it
    from tokenspeed_jax.runtime.step_outputs import StepHandle


class Engine:
    """Continuous-batching engine over one `Scheduler` and one model runner.

    runner: the device side (`Runner`): `dispatch(ops)` enqueues a step and returns at once,
    `collect(handle)` blocks for its `StepResult` (numpy `sampled` i32[R], `logprobs` f32[R],
    `prompt_logprobs` f32[T], NaN where none).
    async_scheduling: overlap planning step N+1 with the device running step N.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        runner: Runner,
        *,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Any = None,
        async_scheduling: bool = False,
    ) -> None:
        self.scheduler = Scheduler(scheduler_config)
        # speculation's draft policy picks among the runner's token buckets
        self.scheduler.token_buckets = tuple(runner.buckets)
        self.runner = runner
        # speculation proposes from the newest token: the synchronous loop (module docstring)
        self.async_scheduling = bool(async_scheduling) and scheduler_config.speculative is None
        self._inflight: tuple[StepOps, StepHandle] | None = None  # overlapped: step N, not collected
        self.clock = StepClock()
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self._tracks: dict[str, Track] = {}
        self._ids = itertools.count()
        self.outstanding_tokens = 0  # prompt + max_tokens summed over the live requests
        self.num_steps = 0
        self.load_s = 0.0  # start-up: building the model and this engine (set by `LLM`)
        self.warmup_s = 0.0  # start-up: wall time of `warmup` calls
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0
        # The engine is single-threaded by design; a second concurrent stepper (e.g. calling
        # LLM.generate while a server thread drives the same engine) would reuse donated device
        # buffers, so it is refused loudly instead.
        self._stepping = threading.Lock()
        self._grammars: GrammarBook | None = None  # built with the first constrained request
        # research hooks (`LLM.update_weights`, `LLM.sleep`): stamped on every output; a sleeping
        # engine (no KV pool) takes no request
        self.weight_version = 0
        self.sleeping = False

    # ------------------------------------------------------------------ requests
    def _check_ids(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The engine's own checks (params type, ints, ids inside the vocabulary); the scheduler
        checks the rest (empty prompt, max_tokens, max_context_len: `Scheduler.check_prompt`)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ValueError(f"prompt must be a list of token ids, got {prompt!r:.80}") from None
        # (SamplingParams already refused negative stop / logit_bias ids)
        for what, toks in (
            ("token id", ids),
            ("stop token id", params.stop_token_ids),
            ("logit_bias token id", params.logit_bias or ()),
        ):
            bad = [t for t in toks if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{what} {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if params.grammar is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs an engine with a tokenizer")
            if not self.runner.supports_token_mask:
                raise ValueError(
                    f"structured_outputs is not supported by this runtime ({type(self.runner).__name__})"
                )
        return ids

    def validate(self, prompt: Sequence[int], params: SamplingParams) -> CheckedPrompt:
        """Check one request without queueing it (ValueError naming the problem); callers that
        must refuse a batch before queueing any of it (`LLM.generate`, the server's n samples)
        validate first and then queue the returned `CheckedPrompt`s."""
        ids = self._check_ids(prompt, params)
        self.scheduler.check_prompt(ids, params.max_tokens)  # empty, max_tokens, max_context_len
        return CheckedPrompt(ids, params)

    def add_request(
        self, prompt: Sequence[int] | CheckedPrompt, params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request; raises ValueError (and queues nothing) on bad input.

        prompt: token ids (checked here: the engine's checks, then the scheduler's), or the
        `CheckedPrompt` that `validate(prompt, params)` returned (not checked again by the
        engine). request_id: None = "req-N", N counting up. RuntimeError while asleep."""
        if self.sleeping:
            raise RuntimeError("the engine is asleep (LLM.sleep): call wake_up() before adding requests")
        if isinstance(prompt, CheckedPrompt):
            if prompt.params is not params and prompt.params != params:
                raise ValueError("a CheckedPrompt must be queued with the params it was validated with")
            ids = prompt.ids
        else:
            ids = self._check_ids(prompt, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if params.grammar is not None:
            if rid in self._tracks:  # the scheduler refuses it too; keep the live matcher
                raise ValueError(f"request id {rid!r} is already live")
            self._book().add(rid, params.grammar)  # ValueError: nothing queued
        try:
            self.scheduler.add_request(
                rid,
                ids,
                params.max_tokens,
                sampling=params.to_options(self.eos_token_ids),
                speculate=params.grammar is None and not params.logprobs,
            )
        except BaseException:
            if params.grammar is not None:
                self._book().drop(rid)
            raise
        track = self._tracks[rid] = Track(ids, params)
        self.outstanding_tokens += track.cost
        return rid

    def abort(self, request_id: str, finish_reason: str = "abort") -> CompletionOutput | None:
        """Drop a live request (its pages come back at once) and return its output so far
        (`finish_reason`, "abort" unless the caller ended it for another reason, e.g. a stop
        string: "stop"); None when it is unknown or already finished."""
        track = self._pop(request_id)
        if track is None:
            return None
        self.scheduler.abort(request_id)
        track.metrics.finish_time = time.perf_counter()
        return self._output(request_id, track, track.token_ids, finish_reason)

    def abort_all(self) -> list[CompletionOutput]:
        """Abort every live request (`abort`); their outputs."""
        outs = [self.abort(rid) for rid in list(self._tracks)]
        return [o for o in outs if o is not None]

    def _book(self) -> GrammarBook:
        if self._grammars is None:
            self._grammars = GrammarBook(
                self.tokenizer, self.vocab_size, self.eos_token_ids, self.scheduler.config.max_batch_requests
            )
        return self._grammars

    def stream(self, request_id: str, start: int = 0) -> StreamState | None:
        """A live request's generated ids from `start` on, with their logprobs / top-k lists
        (the server's streaming and the chat REPL read tokens here, never from the scheduler).
        None once it finished (its `CompletionOutput` came out of `step` / `abort`) or for an
        unknown id."""
        track = self._tracks.get(request_id)
        if track is None:
            return None
        return StreamState(
            start=start,
            token_ids=track.token_ids[start:],
            logprobs=track.logprobs[start:],
            top_logprobs=track.top[start:],
            num_generated=len(track.token_ids),
        )

    def _pop(self, request_id: str) -> Track | None:
        track = self._tracks.pop(request_id, None)
        if track is not None:
            self.outstanding_tokens -= track.cost
            if self._grammars is not None:
                self._grammars.drop(request_id)
        return track

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
        t0 = time.perf_counter()
        compiles = self.runner.num_compiles
        clock = self.clock
        clock.probe()
        ops = self.scheduler.schedule()
        clock.probe()
        outs: list[CompletionOutput] = []
        mask = None
        if ops.num_seqs and self._grammars is not None:
            outs, mask = self._constrain(ops)
        handle = self._dispatch(ops, self._inflight is not None, mask) if ops.num_seqs else None
        prev = self._inflight
        if self.async_scheduling:
            self._inflight = None if handle is None else (ops, handle)
        else:
            prev = None if handle is None else (ops, handle)
        if prev is not None:
            outs += self._finish(*prev)
            if not self.async_scheduling and self.runner.num_compiles == compiles:
                # the step's whole cost (plan, device, update) in the bucket it ran (a lazily
                # compiled shape may run as a covering one): what the "cost" draft policy
                # weighs a bigger bucket by (`Scheduler.note_step_seconds`); never a step
                # that waited for a compile
                self.scheduler.note_step_seconds(prev[0], prev[1].bucket, time.perf_counter() - t0)
            if handle is None and self.async_scheduling and self.scheduler.has_unfinished():
                # nothing could be planned behind the step in flight (its requests all end in
                # it): now that it has freed their slots and pages, refill the device at once,
                # as the synchronous loop would, instead of idling through the caller's turn
                ops = self.scheduler.schedule()
                if ops.num_seqs:
                    mask = self._constrain(ops)[1] if self._grammars is not None else None
                    self._inflight = (ops, self._dispatch(ops, False, mask))
        elif handle is None and self.scheduler.has_unfinished():
            # nothing runs, nothing is in flight and the queue head cannot be admitted: no
            # later step can differ, so fail loudly instead of spinning
            raise RuntimeError(f"scheduler made no progress with waiting requests: {self.scheduler.stats()}")
        clock.call_done(time.perf_counter() - t0)
        return outs

    def drain(self) -> list[CompletionOutput]:
        """Overlapped loop: finish the step in flight (if any) without dispatching another.
        Afterwards every dispatched step is fed back and `stats()` is exact."""
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("Engine.drain called while another thread steps the engine")
        try:
            prev, self._inflight = self._inflight, None
            return [] if prev is None else self._finish(*prev)
        finally:
            self._stepping.release()

    def _constrain(self, ops: StepOps) -> tuple[list[CompletionOutput], np.ndarray | None]:
        """The bitmask of `ops`' constrained sampling rows (None: there are none). When one of
        them has a token in the step in flight, that step is finished first (its outputs are
        returned): the matcher must see that token before the next mask."""
        book = self._grammars
        assert book is not None
        n = ops.num_seqs
        rows = book.constrained_rows(ops.request_ids, ops.sample_mask, n)
        if not rows:
            return [], None
        outs: list[CompletionOutput] = []
        if self._inflight is not None:
            prev_ops = self._inflight[0]
            pending = {
                r
                for _, r in book.constrained_rows(
                    prev_ops.request_ids, prev_ops.sample_mask, prev_ops.num_seqs
                )
            }
            if any(r in pending for _, r in rows):
                prev, self._inflight = self._inflight, None
                outs = self._finish(*prev)
                rows = book.constrained_rows(ops.request_ids, ops.sample_mask, n)
        return outs, (book.bitmask(rows) if rows else None)

    def _dispatch(self, ops: StepOps, pipelined: bool, token_mask: np.ndarray | None = None) -> StepHandle:
        handle = self.runner.dispatch(ops) if token_mask is None else self.runner.dispatch(ops, token_mask)
        self.clock.dispatched(handle, decode=ops.num_tokens == ops.num_seqs, pipelined=pipelined)
        checker = self.scheduler.mirror_checker
        if checker is not None:
            self._check_device_mirrors(checker)
        return handle

    def _check_device_mirrors(self, checker) -> None:
        """Debug mode: the device page tables after the step just dispatched must equal the
        scheduler's numpy twin (itself checked against the authoritative rows) in every slot."""
        honor = self.runner.layout.honor_full_refresh  # the runner's `scheduler.CacheLayout`
        twins = checker.exact if honor else checker.tail_only
        for g, (dev, twin) in enumerate(zip(self.runner.host_mirrors(), twins, strict=True)):
            if not np.array_equal(dev, twin):
                bad = np.flatnonzero((dev != twin).any(axis=1)).tolist()
                raise AssertionError(
                    f"device page-table mirror of group {g} differs from the scheduler's in slots {bad}"
                )

    def _finish(self, ops: StepOps, handle: StepHandle) -> list[CompletionOutput]:
        """Wait for a dispatched step, feed it back, and turn finished requests into outputs."""
        blocked = not handle.is_ready()
        t = time.perf_counter()
        result = self.runner.collect(handle)
        now = time.perf_counter()
        self.clock.waited(now - t, blocked)
        update = self.scheduler.update_step(ops, result.sampled, result.accepted)
        finished = update.finished
        book = self._grammars if self._grammars is not None and len(self._grammars) else None
        ended, count = route_results(self._tracks, ops, result, now, update.applied, update.spec_tokens, book)
        self.num_generated_tokens += count
        self.num_steps += 1
        self.num_prefill_tokens += int(ops.num_tokens - ops.sample_mask[: ops.num_seqs].sum())
        outs = []
        for fin in finished:
            track = self._pop(fin.request_id)  # its matcher goes too
            assert track is not None, fin.request_id
            track.metrics.finish_time = now
            track.metrics.num_cached_tokens = fin.num_cached_tokens
            track.metrics.num_retractions = fin.num_retractions
            outs.append(self._output(fin.request_id, track, fin.token_ids, fin.finish_reason))
        for rid in ended:  # grammar complete: ends here, whatever the scheduler planned next
            out = self.abort(rid, finish_reason="stop") if rid in self._tracks else None
            if out is not None:
                if out.metrics is not None:
                    out.metrics.finish_time = now
                outs.append(out)
        return outs

    def _output(self, rid: str, track: Track, token_ids: list[int], reason: str) -> CompletionOutput:
        # generated tokens sampled before a retraction keep their logprobs; trim to what exists
        try:
            text = self.tokenizer.decode(token_ids) if self.tokenizer is not None else None
        except Exception:  # one request's text must not fail the step that finished the others
            text = None
        return CompletionOutput(
            request_id=rid,
            prompt_token_ids=list(track.prompt),
            token_ids=list(token_ids),
            finish_reason=reason,
            text=text,
            logprobs=(
                track.logprobs[: len(token_ids)]
                if track.params.logprobs or track.params.top_logprobs
                else None
            ),
            prompt_logprobs=track.prompt_logprobs,
            metrics=track.metrics,
            top_logprobs=track.top[: len(token_ids)] if track.params.top_logprobs else None,
            weight_version=self.weight_version,
        )

    def warmup(self, max_kv_len: int | None = None, *, progress: bool = False, workers: int = 2) -> int:
        """Make the runner's shape keys ready now (`ModelRunner.warmup`: every (token, kv) bucket
        pair, or those with kv buckets up to `max_kv_len`); returns how many it made ready."""
        t0 = time.perf_counter()
        made = self.runner.warmup(
            self.scheduler.padding_ops(), max_kv_len=max_kv_len, progress=progress, workers=workers
        )
        self.warmup_s += time.perf_counter() - t0
        return made

    def startup_stats(self) -> dict[str, float]:
        """Start-up breakdown: `load_s`, `warmup_s` (wall), and over the step shapes made ready
        so far (`step_programs.StepPrograms.summary`: compiled / loaded / background counts,
        trace, XLA compile and executable-read seconds, summed over worker threads)."""
        out = {"load_s": self.load_s, "warmup_s": self.warmup_s}
        programs = self.runner.programs
        if programs is not None:  # the multi-process runner keeps no per-shape record
            out.update({("load_exe_s" if k == "load_s" else k): v for k, v in programs.summary().items()})
        return out

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Scheduler counters + engine counters + the loop timing of `StepClock.summary`."""
        out = self.scheduler.stats()
        out["num_engine_steps"] = self.num_steps
        out["num_generated_tokens"] = self.num_generated_tokens
        out["async_scheduling"] = self.async_scheduling
        out.update(self.clock.summary())
        out["num_compiles"] = self.runner.num_compiles
        out["num_prefill_tokens"] = self.num_prefill_tokens
        host_kv = getattr(self.runner, "host_kv", None)  # the host KV tier's copies (issue 49)
        if host_kv is not None:
            out.update(host_kv.stats, host_copy_compiles=host_kv.num_compiles)
        out["startup"] = self.startup_stats()
        if self._grammars is not None:
            out.update(self._grammars.stats())
        return out
