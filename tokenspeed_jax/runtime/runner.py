"""`ModelRunner`: applies one `StepOps` on the device in a single jitted, donated step.

step(params, state, ops) = page-table update (every group) -> input tokens (placeholders flagged
`token_from_prev` read the slot's last sampled token from the state) -> write locations from the
updated mirrors -> paged forward (K/V + conv writes, attention through the page tables) ->
sampling (+ prompt logprobs when the step asks for any) -> each sampling row's token is kept as
its slot's last token.

`dispatch(ops)` only enqueues the step (JAX dispatch is asynchronous) and returns a handle;
`collect(handle)` blocks for its host results; `step = collect(dispatch(ops))`. The overlapped
engine dispatches step N+1 before collecting step N.

Shapes: rows are fixed at `max_batch_requests`. A step's shape key is (token bucket, kv bucket):
* token bucket: the token dimension is padded up to the smallest of the powers of two from
  `min_token_bucket` up to `max_scheduled_tokens` (always a bucket), so a decode step does not
  pay for a full prefill's worth of padding;
* kv bucket (reference backend): the page tables the attention / conv reads get only the columns
  that cover the step's longest row, rounded up to a ladder of powers of two of tokens from
  `min_kv_bucket` (`step_inputs.kv_levels`), so the jnp reference gathers K/V in proportion to
  the real context, not to `max_context_len`. The Pallas kernels bound their loops by kv_len
  themselves and always see the full width (one kv level: their compile count is unchanged).
One compile per shape key; `num_compiles` counts traces so tests and benchmarks can prove it, and
`warmup()` compiles every (token, kv) pair (`shape_keys`), so serving never compiles.

Inputs: the StepOps travel as one int32 and one float32 buffer (`step_inputs`, driven by the
StepOps schema), unpacked inside the jit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from scheduler.cache_layout import CacheLayout
from scheduler.mirror_check import clamped_rows
from scheduler.step_ops import StepOps, device_schema
from tokenspeed_jax.models.batch import make_paged_batch
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.decoder import CausalLM
from tokenspeed_jax.page_table import update_rows
from tokenspeed_jax.runtime.backends import get_paged_attention, get_short_conv, resolve_backend
from tokenspeed_jax.runtime.sampling import (
    MAX_TOP_LOGPROBS,
    init_penalty_state,
    penalize_step,
    prompt_logprobs,
    sample,
    top_logprobs,
)
from tokenspeed_jax.runtime.sharding import TensorParallel, place, prepare_model
from tokenspeed_jax.runtime.state import DeviceState, init_state
from tokenspeed_jax.runtime.step_inputs import StepLayout, kv_levels, layout_for, pack, unpack

logger = logging.getLogger(__name__)

# per-row StepOps fields (schema axis "row"): what the LM head / sampler slice to the used rows
_ROW_FIELDS = tuple(name for name, axis, _ in device_schema(StepOps) if axis == "row")
DEFAULT_MIN_KV_BUCKET = 256  # tokens: the shortest kv bucket (fewer levels = fewer compiles)
# device outputs of one step: sampled ids i32[R], logprobs f32[R], prompt logprobs f32[T],
# (top ids i32[R, K], top logprobs f32[R, K])
StepOutputs: TypeAlias = tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host copies of one step's outputs (R = max_batch_requests, T = max_scheduled_tokens).

    sampled i32[R]: token of each row whose `sample_mask` is set, -1 elsewhere.
    logprobs f32[R]: log-probability of that token (unmodified log-softmax); NaN where no token.
    prompt_logprobs f32[T]: logprob of `prompt_targets[t]` after token t; NaN where target -1.
    top_ids i32[R, K], top_logprobs f32[R, K] (K = sampling.MAX_TOP_LOGPROBS): each sampling
    row's K most likely tokens under the unmodified log-softmax, descending; None on steps where
    no row asked for them (`StepOps.top_logprobs`), -1 / NaN on rows that sample nothing.
    """

    sampled: np.ndarray
    logprobs: np.ndarray
    prompt_logprobs: np.ndarray
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class StepHandle:
    """A dispatched step: device futures of its outputs (None for an empty step)."""

    tokens: jax.Array | None
    logprobs: jax.Array | None
    prompt_logprobs: jax.Array | None
    bucket: int
    top: tuple[jax.Array, jax.Array] | None = None  # (top ids, top logprobs) when asked for

    def is_ready(self) -> bool:
        """True once the device has finished the step (never blocks)."""
        # ArrayImpl.is_ready exists at run time; jax.Array's type stubs do not declare it
        return self.tokens is None or self.tokens.is_ready()  # type: ignore[attr-defined]


def token_buckets(max_scheduled_tokens: int, min_bucket: int = 16) -> tuple[int, ...]:
    """Powers of two from `min_bucket` below `max_scheduled_tokens`, then the max itself."""
    out, b = [], max(1, min_bucket)
    while b < max_scheduled_tokens:
        out.append(b)
        b *= 2
    return (*out, max_scheduled_tokens)


class ModelRunner:
    """Owns the device state and the jitted step of one model.

    Args:
      model_config: the model's `ModelConfig`.
      model: the `CausalLM` (split once into a static graphdef + a params pytree argument).
      layout: the `scheduler.CacheLayout` the Scheduler was built from (`scheduler.cache_layout`):
        group page sizes and widths, pool size, mirror slots, layer -> group map, R and T of
        the StepOps, honor_full_refresh.
      backend: "auto" | "pallas" | "reference" attention.
      min_token_bucket, min_kv_bucket: the shortest token bucket and kv bucket (in tokens).
      mesh: a 1-D "tp" `jax.sharding.Mesh` to run tensor-parallel on (`tokenspeed_jax.runtime.sharding`);
        None = the default device, unsharded (the single-device path, unchanged).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        model: CausalLM,
        layout: CacheLayout,
        *,
        backend: str = "auto",
        min_token_bucket: int = 16,
        min_kv_bucket: int = DEFAULT_MIN_KV_BUCKET,
        mesh: Mesh | None = None,
    ) -> None:
        self.config = model_config
        self.layout = layout
        self.max_batch_requests = layout.scheduler_config.max_batch_requests
        self.max_scheduled_tokens = layout.scheduler_config.max_scheduled_tokens
        self.backend = resolve_backend(backend)
        self.buckets = token_buckets(self.max_scheduled_tokens, min_token_bucket)
        widths, page_sizes = layout.widths, layout.page_sizes
        if self.backend == "reference":
            self.kv_levels = kv_levels(widths, page_sizes, min_kv_bucket)
        else:  # Pallas: loops bounded by kv_len on the device; one full-width level
            self.kv_levels = ((max(w * b for w, b in zip(widths, page_sizes)), widths),)
        self.num_compiles = 0
        self._layouts: dict[tuple[int, tuple[int, ...]], StepLayout] = {}

        self._tp = None if mesh is None else TensorParallel(mesh, model_config)
        if self._tp is not None:
            prepare_model(model, self._tp.tp)  # conv in_proj re-layout (before the split)
        self._graphdef, self.params = nnx.split(model)
        make_state = functools.partial(
            init_state, model_config, layout.layer_groups, page_sizes, widths,
            num_pages=layout.num_pages, max_live_requests=layout.max_live_requests,
        )  # fmt: skip
        self._attn = get_paged_attention(self.backend)
        self._conv: Callable[..., jax.Array] | None = get_short_conv(self.backend)
        # device-resident token counts of each slot for the penalties (sampling.PenaltyState)
        make_penalties = functools.partial(init_penalty_state, layout.max_live_requests,
                                           model_config.vocab_size)
        if self._tp is None:
            self.state = make_state()
            self.penalties = make_penalties()
        else:
            tp = self._tp
            param_sh = tp.param_shardings(self.params)
            self.params = place(self.params, param_sh)  # per shard across processes
        # The jitted step takes the params as their flat list of arrays: flattening the nnx.State
        # (a Python callback per Variable) on every call cost ~0.1 ms of host time per step.
        self.param_leaves, self._param_def = jax.tree.flatten(self.params)
        if self._tp is None:
            self._step = jax.jit(self._step_impl, donate_argnums=(1, 2), static_argnums=(5,))
        else:
            state_sh = tp.state_shardings(jax.eval_shape(make_state))
            # built sharded in place: the full pools never sit on one device
            self.state = jax.jit(make_state, out_shardings=state_sh)()
            self._attn, self._conv = tp.wrap_attention(self._attn), tp.wrap_conv(self._conv)
            rep = tp.replicated
            self.penalties = jax.jit(make_penalties, out_shardings=rep)()
            self._step = jax.jit(
                self._step_impl, donate_argnums=(1, 2), static_argnums=(5,),
                in_shardings=(jax.tree.leaves(param_sh), state_sh, rep, rep, rep),
                out_shardings=(state_sh, rep, rep, rep, rep, rep),
            )  # fmt: skip

    # ------------------------------------------------------------------ device side
    def _step_impl(self, param_leaves: list[jax.Array], state: DeviceState, penalties: Any,
                   i32: jax.Array, f32: jax.Array,
                   layout: StepLayout) -> tuple[DeviceState, Any, *StepOutputs]:
        self.num_compiles += 1  # Python body runs once per trace = once per compile
        ops = unpack(i32, f32, layout)
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._param_def, param_leaves))
        mirrors = tuple(
            update_rows(
                mirror, ops["req_slots"], g["begins"], g["sizes"], g["new_pages"],
                ops["full_refresh"], g["rows"], g["row_lens"],
                honor_full_refresh=self.layout.honor_full_refresh, hole_slots=g["hole_slots"],
            )
            for mirror, g in zip(state.mirrors, ops["groups"], strict=True)
        )  # fmt: skip
        batch = make_paged_batch(
            mirrors, ops["req_slots"], ops["cu_q_lens"], ops["kv_lens"], ops["positions"],
            ops["token_rows"], page_sizes=self.layout.page_sizes, num_pages=self.layout.num_pages,
            layer_groups=self.layout.layer_groups, kv_cols=layout.cols,
        )  # fmt: skip
        slots = ops["req_slots"]
        num_slots = state.last_tokens.shape[0]
        # overlapped scheduling: a flagged token is the one the previous step sampled for the
        # row's slot; it never travelled to the host and back
        token_slots = jnp.take(slots, ops["token_rows"], mode="clip")
        prev_tokens = jnp.take(state.last_tokens, token_slots, mode="clip")
        # resolved in place: everything below that reads the input ids sees the real tokens
        ops["token_ids"] = jnp.where(ops["token_from_prev"], prev_tokens, ops["token_ids"])
        hidden, caches = model(ops["token_ids"], state.caches, batch, self._attn, self._conv)

        t = hidden.shape[0]
        # A step has at most one row per token, so rows >= min(R, T) are padding: the LM head and
        # the sampler only run on the first n rows (a 16-token decode bucket pays for 16, not R).
        n = min(self.max_batch_requests, t)
        rows = {k: ops[k][:n] for k in _ROW_FIELDS}
        last = jnp.clip(ops["cu_q_lens"][1 : n + 1] - 1, 0, t - 1)  # each row's last token
        logits = model.logits(hidden[last])
        if self._tp is not None:  # vocab-sharded under TP: the sort / argmax want whole rows
            logits = self._tp.gather_logits(logits)
        penalties, processed = penalize_step(penalties, logits, ops)
        tokens, logprobs = sample(
            processed, rows["temperature"], rows["top_k"], rows["top_p"],
            rows["seeds"], rows["sample_index"], raw_logits=logits,
        )  # fmt: skip
        pad = self.max_batch_requests - n
        mask = rows["sample_mask"]
        keep = jnp.where(mask, slots[:n], num_slots)  # each sampling row's slot; others dropped
        last_tokens = state.last_tokens.at[keep].set(tokens, mode="drop")
        tokens = jnp.pad(jnp.where(mask, tokens, -1), (0, pad), constant_values=-1)
        logprobs = jnp.pad(jnp.where(mask, logprobs, jnp.nan), (0, pad), constant_values=jnp.nan)
        k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
        top_ids, top_lp = jax.lax.cond(  # the [n, V] top-k only on steps that report it
            jnp.any(rows["top_logprobs"] > 0), top_logprobs,
            lambda _: (jnp.full((n, k), -1, jnp.int32), jnp.full((n, k), jnp.nan, jnp.float32)),
            logits,
        )  # fmt: skip
        top_ids = jnp.pad(jnp.where(mask[:, None], top_ids, -1), ((0, pad), (0, 0)),
                          constant_values=-1)
        top_lp = jnp.pad(jnp.where(mask[:, None], top_lp, jnp.nan), ((0, pad), (0, 0)),
                         constant_values=jnp.nan)
        targets = ops["prompt_targets"]
        # Full [T, V] logits only on steps that want prompt logprobs (lax.cond skips them else).
        plp = jax.lax.cond(
            jnp.any(targets >= 0),
            lambda h: prompt_logprobs(model.logits(h), targets),
            lambda h: jnp.full((t,), jnp.nan, jnp.float32),
            hidden,
        )
        return (DeviceState(mirrors=mirrors, caches=caches, last_tokens=last_tokens), penalties,
                tokens, logprobs, plp, (top_ids, top_lp))

    # ------------------------------------------------------------------ host side
    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if num_tokens <= b:
                return b
        raise ValueError(f"num_tokens {num_tokens} > max_scheduled_tokens {self.buckets[-1]}")

    @property
    def shape_keys(self) -> tuple[tuple[int, int], ...]:
        """Every (token bucket, kv bucket tokens) pair a step can have: one compile each."""
        return tuple((b, t) for b in self.buckets for t, _ in self.kv_levels)

    def kv_bucket_for(self, ops: StepOps) -> tuple[int, tuple[int, ...]]:
        """(tokens, kv columns per group) of the shortest kv level covering the step's longest
        row (`kv_lens`) and every refreshed row's length (`row_lens`)."""
        return self.kv_levels[self._kv_level(ops)]

    def _kv_level(self, ops: StepOps) -> int:
        need = int(ops.kv_lens.max())
        row_lens = [int(g.row_lens.max()) for g in ops.groups]
        for level, (tokens, cols) in enumerate(self.kv_levels):
            if tokens >= need and all(c >= n for c, n in zip(cols, row_lens)):
                return level
        return len(self.kv_levels) - 1

    def _layout(self, bucket: int, cols: tuple[int, ...]) -> StepLayout:
        key = (bucket, cols)
        lay = self._layouts.get(key)
        if lay is None:
            deltas = tuple(g.delta_width for g in self.layout.groups)
            lay = self._layouts[key] = layout_for(self.max_batch_requests, bucket, deltas, cols)
        return lay

    def _run(self, ops: StepOps, bucket: int, cols: tuple[int, ...]) -> StepOutputs:
        layout = self._layout(bucket, cols)
        i32, f32 = pack(ops, layout)
        if self._tp is not None:
            i32, f32 = jax.device_put((i32, f32), self._tp.replicated)
        # else the numpy buffers go to the jitted call as they are: its C++ dispatch moves them
        # to the device for a fraction of what a Python-level `jax.device_put` costs per step
        self.state, self.penalties, tokens, logprobs, plp, top = self._step(
            self.param_leaves, self.state, self.penalties, i32, f32, layout)
        return tokens, logprobs, plp, top

    def warmup(self, padding_ops: StepOps, max_kv_len: int | None = None) -> int:
        """Compile the shape keys (token bucket x kv bucket, `shape_keys`) now, so serving does
        not stall on XLA, by running an all-padding StepOps through each: padding rows (slot -1)
        and padding tokens drop every write, so the device state is unchanged.

        Compile policy: None (default) compiles every pair, after which serving never compiles.
        `max_kv_len` = L compiles every token bucket with the kv buckets up to the one covering L
        tokens; a step whose longest row is longer compiles its key on first use (once; counted
        in `num_compiles`, at most `len(shape_keys)` in all). Returns the compilations it ran.
        """
        if padding_ops.num_seqs:
            raise ValueError(f"warmup needs an all-padding StepOps, got {padding_ops.num_seqs} rows")
        levels = self.kv_levels
        if max_kv_len is not None:
            if max_kv_len < 1:
                raise ValueError(f"max_kv_len must be >= 1, got {max_kv_len}")
            cover = next((i for i, (t, _) in enumerate(levels) if t >= max_kv_len), len(levels) - 1)
            levels = levels[: cover + 1]
        before = self.num_compiles
        for bucket in self.buckets:
            for _, cols in levels:
                self._run(padding_ops, bucket, cols)
        jax.block_until_ready(self.state)
        return self.num_compiles - before

    def step(self, ops: StepOps) -> StepResult:
        """Applies one `StepOps`; returns the sampled tokens (numpy). Empty steps skip the device."""
        return self.collect(self.dispatch(ops))

    def dispatch(self, ops: StepOps) -> StepHandle:
        """Enqueue one `StepOps` on the device and return at once (the state advances to the
        step's output futures, so the next dispatch queues behind this one)."""
        if ops.num_seqs == 0:
            return StepHandle(None, None, None, 0)
        self.warn_clamped(ops)
        bucket, level = self.step_shape(ops)
        return self.handle_for(ops, bucket, *self._run(ops, bucket, self.kv_levels[level][1]))

    def warn_clamped(self, ops: StepOps) -> None:
        """DESIGN §6 rule 3: a row whose update outgrows its mirror is clamped on the device (never
        a crash); name its request. `add_request` admits no such request, so this is the guard
        for hand-built StepOps (vectorised: a few µs per step)."""
        lay = self.layout
        for g, grp in enumerate(ops.groups):
            rows = clamped_rows(ops.req_slots, grp.begins, grp.sizes, ops.full_refresh,
                                grp.row_lens, lay.widths[g], lay.honor_full_refresh)
            for i in rows.tolist():
                rid = ops.request_ids[i] if i < len(ops.request_ids) else f"row {i}"
                logger.warning("page-table row of request %s in cache group %s outgrows width %d; "
                               "clamped", rid, lay.groups[g].group_id, lay.widths[g])

    def step_shape(self, ops: StepOps) -> tuple[int, int]:
        """(token bucket, index into `kv_levels`) of a non-empty step: its compiled shape."""
        return self.bucket_for(int(ops.num_tokens)), self._kv_level(ops)

    def handle_for(self, ops: StepOps, bucket: int, tokens: jax.Array, logprobs: jax.Array,
                   plp: jax.Array | None, top: tuple[jax.Array, jax.Array] | None) -> StepHandle:
        """Wrap one dispatched step's device outputs; copies back only what the step asked for."""
        for x in (tokens, logprobs):  # start the device->host copies now, not when collected
            x.copy_to_host_async()
        if ops.prompt_targets[: ops.num_tokens].max(initial=-1) < 0:
            plp = None  # no prompt logprobs asked for in this step: nothing to copy back
        if not np.asarray(ops.top_logprobs).any():
            top = None  # copy the [R, K] top-k back only when asked for
        return StepHandle(tokens, logprobs, plp, bucket, top)

    def collect(self, handle: StepHandle) -> StepResult:
        """Block until a dispatched step is done; its host results."""
        r, t = self.max_batch_requests, self.max_scheduled_tokens
        if handle.tokens is None:
            return StepResult(
                np.full(r, -1, np.int32), np.full(r, np.nan, np.float32),
                np.full(t, np.nan, np.float32),
            )  # fmt: skip
        plp_full = np.full(t, np.nan, np.float32)
        if handle.prompt_logprobs is not None:  # else all NaN: no copy
            plp_full[:handle.bucket] = np.asarray(handle.prompt_logprobs)
        top_ids = top_lp = None
        if handle.top is not None:
            top_ids, top_lp = np.asarray(handle.top[0]), np.asarray(handle.top[1])
        return StepResult(np.asarray(handle.tokens), np.asarray(handle.logprobs), plp_full,
                          top_ids, top_lp)

    def host_mirrors(self) -> list[np.ndarray]:
        """The device page-table mirrors after the last dispatched step (blocks; debug checks)."""
        return [np.asarray(m) for m in self.state.mirrors]
