"""`ModelRunner`: applies one `StepOps` on the device in a single jitted, donated step.

step(params, state, ops) = unpack the two input buffers -> page-table update (every group,
`page_table.update_rows`) -> write locations from the updated mirrors (`make_paged_batch`) ->
input tokens (placeholders flagged `token_from_prev` read the slot's last sampled token from the
state) -> paged forward (K/V + conv writes, attention through the page tables) -> sampling
(`sampling.sample_rows`: + top-k and prompt logprobs when the step asks for any; each sampling
row's token is kept as its slot's last token).

Structured outputs: the step also takes `token_mask` i32[R, ceil(V / 32)], the host's bitmask of
allowed tokens per row (`structured.GrammarBook`); a step with no constrained row passes a
device-resident all-ones constant (no transfer) and the sampler skips the mask (lax.cond).

`dispatch(ops)` only enqueues the step (JAX dispatch is asynchronous) and returns a handle;
`collect(handle)` blocks for its host results; `step = collect(dispatch(ops))`. The overlapped
engine dispatches step N+1 before collecting step N.

Shapes: rows are fixed at `max_batch_requests`; a step's shape key is (token bucket, kv bucket),
chosen by the runner's `shapes.ShapePolicy`. One compiled executable per shape key, held by
`step_programs.StepPrograms`: `warmup()` makes every (token, kv) pair (`shape_keys`) ready ahead
of time, read from the executable store (`executables`: no trace, no compile) or compiled in a
thread pool, so serving never compiles; a shape left out runs as a ready covering shape while
it compiles in the background. `num_compiles` counts traces, `num_loaded` executables read.

Inputs: one int32 + one float32 buffer (`step_inputs`), unpacked in the jit into `DeviceOps`;
`execute(shape, i32, f32)` runs buffers packed elsewhere (multi-process followers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from pallas_kernels import kv_quant
from scheduler.cache_layout import CacheLayout
from scheduler.step_ops import StepOps
from tokenspeed_jax.models.batch import make_paged_batch
from tokenspeed_jax.models.decoder import CausalLM
from tokenspeed_jax.models.layer_scan import LayerRun, ScannedGraph
from tokenspeed_jax.runtime import executables
from tokenspeed_jax.runtime.backends import (
    check_fp8_support,
    devices_of,
    get_paged_attention,
    get_short_conv,
    jnp_layout,
    resolve_backend,
)
from tokenspeed_jax.runtime.device_ops import input_tokens, update_mirrors
from tokenspeed_jax.runtime.executables import ExecutableStore
from tokenspeed_jax.runtime.host_tier import HostKVPool
from tokenspeed_jax.runtime.prepare import PreparedModel
from tokenspeed_jax.runtime.sampling import PenaltyState, init_penalty_state, sample_rows
from tokenspeed_jax.runtime.shapes import (
    DEFAULT_MIN_KV_BUCKET,
    DEFAULT_MIN_TOKEN_BUCKET,
    ShapePolicy,
    StepShape,
)
from tokenspeed_jax.runtime.sharding import TensorParallel, place
from tokenspeed_jax.runtime.state import DeviceState, init_state
from tokenspeed_jax.runtime.step_inputs import StepLayout, layout_for, pack, unpack, warn_clamped
from tokenspeed_jax.runtime.step_outputs import StepHandle, StepOutputs, StepResult, host_results
from tokenspeed_jax.runtime.step_programs import StepPrograms


class ModelRunner:
    """Owns the device state and the jitted step of one model.

    Args:
      prepared: the model after `runtime.prepare.prepare` (KV heads, TP re-layouts,
        quantization and tiling done once, before any replica): split once into a static
        graphdef + a params pytree argument; the runner never changes its layout.
      layout: the `scheduler.CacheLayout` the Scheduler was built from (`scheduler.cache_layout`):
        group page sizes and widths, pool size, mirror slots, layer -> group map, R and T of
        the StepOps, honor_full_refresh.
      backend: "auto" | "pallas" | "reference" | "native" attention (`runtime.backends`).
      min_token_bucket, min_kv_bucket: the shortest token bucket and kv bucket (in tokens).
        min_token_bucket None (the default): 16, plus a 1-token bucket for a lone decode when
        the devices are CPUs (`shapes.token_buckets`: there a padded row costs what a real one
        does, so a lone decode on 16 rows reads ~3x longer), speculation included unless its
        draft_policy is "padding" (drafts only in a bucket's padding, which a 1-token bucket
        has none of); an int: powers of two from it.
      mesh: a 1-D "tp" `jax.sharding.Mesh` of `prepared.tensor_parallel_size` devices to run
        tensor-parallel on (`tokenspeed_jax.runtime.sharding`); None = the default device,
        unsharded (the single-device path).
      executable_store, lazy_compile: where compiled step shapes persist, and how a shape that
        is not ready yet runs ("background": a ready covering shape meanwhile; "sync").
      scan_layers: stack each run of identical layers (params and pools) and apply it with
        `lax.scan` (`models.layer_scan`): one layer body traced and compiled per run.
      kv_cache_dtype: "auto" (K/V pools in the model dtype), "int8" or "fp8_e4m3" (quantized
        values + f16 per-token-head scales, `pallas_kernels.kv_quant`).

    Attributes: `layout` (as given), `shapes` (the `ShapePolicy`), `num_compiles` (step traces),
    `params` (nnx.State) and `state` / `penalties` (device state, advanced by every step).
    """

    def __init__(
        self,
        prepared: PreparedModel,
        layout: CacheLayout,
        *,
        backend: str = "auto",
        min_token_bucket: int | None = None,
        min_kv_bucket: int = DEFAULT_MIN_KV_BUCKET,
        mesh: Mesh | None = None,
        executable_store: ExecutableStore | None = None,
        lazy_compile: str = "background",
        scan_layers: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.config = prepared.config
        self.quantization = prepared.quantization
        kv_quant.quantized_dtype(kv_cache_dtype)  # ValueError naming it when unknown
        self.kv_cache_dtype = kv_cache_dtype
        self.layout = layout
        if lazy_compile not in ("background", "sync"):
            raise ValueError(f"lazy_compile must be 'background' or 'sync', got {lazy_compile!r}")
        self.lazy_compile = lazy_compile
        self._tp = None if mesh is None else TensorParallel(mesh, prepared.config)
        prepared.check_mesh(None if self._tp is None else self._tp.tp)
        self._init_shapes(backend, mesh, min_token_bucket, min_kv_bucket)
        self._init_state(prepared.net, scan_layers)
        self._init_programs(executable_store, devices_of(mesh))
        self.host_kv: HostKVPool | None = None  # the host KV tier (`attach_host_tier`)

    def _init_shapes(
        self, backend: str, mesh: Mesh | None, min_token_bucket: int | None, min_kv_bucket: int
    ) -> None:
        """The step shapes: backend, row / token caps, the token and kv bucket ladders."""
        layout = self.layout
        self.max_batch_requests = layout.scheduler_config.max_batch_requests
        self.max_scheduled_tokens = layout.scheduler_config.max_scheduled_tokens
        spec = layout.scheduler_config.speculative
        self.num_speculative = 0 if spec is None else spec.num_speculative_tokens  # static
        self.backend = resolve_backend(backend)
        check_fp8_support(self.kv_cache_dtype, self.backend, mesh)
        platform = devices_of(mesh)[0].platform
        self.shapes = ShapePolicy.build(
            layout.widths,
            layout.page_sizes,
            self.max_scheduled_tokens,
            backend=self.backend,
            min_token_bucket=DEFAULT_MIN_TOKEN_BUCKET if min_token_bucket is None else min_token_bucket,
            min_kv_bucket=min_kv_bucket,
            # with speculation too: a step whose rows propose nothing (or whose drafts would not
            # pay for a bigger bucket) runs a lone decode in it (`speculative.choose_drafts`);
            # not with "padding", whose drafts only ride in the padding the 1-token bucket lacks
            lone_decode=min_token_bucket is None
            and platform == "cpu"
            and (spec is None or spec.draft_policy != "padding"),
        )
        self.num_compiles = 0
        self._layouts: dict[StepShape, StepLayout] = {}

    def _init_state(self, model: CausalLM, scan_layers: bool) -> None:
        """The params argument and the device state (pools, mirrors, penalties), sharded under
        tensor parallelism; the kernels the step calls."""
        layout, config, tp = self.layout, self.config, self._tp
        # scan_layers: the layers' params and pools stacked per run of identical layers, applied
        # by lax.scan (models/layer_scan.py): one layer body to trace and compile, not L
        self._scan: ScannedGraph | None = None
        params: Any  # the model's nnx.State, or scan_layers' {"shell", "runs"}
        if scan_layers:
            self._scan, params = ScannedGraph.split(model, layout.layer_groups)
        else:
            self._graphdef, params = nnx.split(model)
        make_state = functools.partial(
            init_state, config, layout.layer_groups, layout.page_sizes, layout.widths,
            num_pages=layout.num_pages, max_live_requests=layout.max_live_requests,
            runs=None if self._scan is None else self._scan.runs,
            bits_pools=jnp_layout(self.backend),  # bf16 / fp8 as bits (pool_bits)
            kv_cache_dtype=self.kv_cache_dtype, state_pages=layout.state_pages,
        )  # fmt: skip
        # device-resident token counts of each slot for the penalties (sampling.PenaltyState)
        make_penalties = functools.partial(init_penalty_state, layout.max_live_requests, config.vocab_size)
        self._attn = get_paged_attention(self.backend)
        self._conv: Callable[..., jax.Array] | None = get_short_conv(self.backend)
        self._gather_logits: Callable[[jax.Array], jax.Array] | None = None
        self._shardings: dict[str, Any] = {}  # the jitted step's in / out shardings (TP only)
        if tp is None:
            self.state, self.penalties = make_state(), make_penalties()
        else:
            param_sh = tp.param_shardings(params)
            params = place(params, param_sh)  # per shard across processes
            state_sh = tp.state_shardings(jax.eval_shape(make_state))
            # built sharded in place: the full pools never sit on one device
            self.state = jax.jit(make_state, out_shardings=state_sh)()
            rep = tp.replicated
            self.penalties = jax.jit(make_penalties, out_shardings=rep)()
            self._attn, self._conv = tp.wrap_attention(self._attn), tp.wrap_conv(self._conv)
            self._gather_logits = tp.gather_logits  # vocab-sharded: the sampler wants whole rows
            self._shardings = dict(
                in_shardings=(jax.tree.leaves(param_sh), state_sh, rep, rep, rep, rep),
                out_shardings=(state_sh, rep, rep, rep, rep, rep, rep),
            )
        self.params = params
        self._make_state, self._make_penalties = make_state, make_penalties
        # The jitted step takes the params as their flat list of arrays: flattening the nnx.State
        # (a Python callback per Variable) on every call cost ~0.1 ms of host time per step.
        self.param_leaves, self._param_def = jax.tree.flatten(self.params)
        # every bit set: the token mask of steps with no constrained row (never transferred)
        words = (config.vocab_size + 31) // 32
        self._no_mask = jnp.full((self.max_batch_requests, words), -1, jnp.int32)
        if tp is not None:
            self._no_mask = jax.device_put(self._no_mask, tp.replicated)

    def _init_programs(self, executable_store: ExecutableStore | None, devices: list[Any]) -> None:
        """The jitted step and the per-shape executables (`StepPrograms`)."""
        self._step = jax.jit(self._step_impl, donate_argnums=(1, 2), static_argnums=(6,), **self._shardings)
        # what the step is compiled for, fixed at construction: lowering never reads the live
        # (donated) state arrays, so a background compile runs beside the step loop
        self._abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            (self.param_leaves, self.state, self.penalties),
        )
        self._mask_abstract = jax.ShapeDtypeStruct(
            self._no_mask.shape, jnp.int32, sharding=self._no_mask.sharding
        )
        self._input_sharding = None if self._tp is None else self._tp.replicated
        # Stored executables load onto `devices` by name: left to itself, deserialization would
        # spread a one-device program over every local device (4 virtual CPUs, 8 GPUs) and its
        # first call would fail
        self.programs = StepPrograms(
            self._lower, None if executable_store is None else self._program_key, executable_store, devices
        )

    # ------------------------------------------------------------------ device side
    def _step_impl(
        self,
        param_leaves: list[jax.Array],
        state: DeviceState,
        penalties: PenaltyState,
        i32: jax.Array,
        f32: jax.Array,
        token_mask: jax.Array,
        layout: StepLayout,
    ) -> tuple[DeviceState, PenaltyState, *StepOutputs]:
        self.num_compiles += 1  # Python body runs once per trace = once per compile
        ops = unpack(i32, f32, layout)
        params = jax.tree.unflatten(self._param_def, param_leaves)
        mirrors = update_mirrors(state.mirrors, ops, self.layout.honor_full_refresh)
        batch = make_paged_batch(
            mirrors, ops.req_slots, ops.cu_q_lens, ops.kv_lens, ops.positions,
            ops.token_rows, page_sizes=self.layout.page_sizes, num_pages=self.layout.num_pages,
            layer_groups=self.layout.layer_groups, kv_cols=layout.cols,
            group_pages=self.layout.group_pages,
        )  # fmt: skip
        # resolved in place: everything below that reads the input ids sees the real tokens
        ops = ops.replace(token_ids=input_tokens(ops, state.last_tokens))
        if self._scan is not None:
            hidden, caches, model = self._scan.forward(
                params, ops.token_ids, state.caches, batch, self._attn, self._conv
            )
        else:
            model = nnx.merge(self._graphdef, params)
            hidden, caches = model(ops.token_ids, state.caches, batch, self._attn, self._conv)
        penalties, last_tokens, tokens, logprobs, plp, top, accepted = sample_rows(
            hidden,
            ops,
            penalties,
            state.last_tokens,
            lm_head=model.logits,
            max_rows=self.max_batch_requests,
            gather_logits=self._gather_logits,
            token_mask=token_mask,
            num_speculative=self.num_speculative,
        )
        return (
            DeviceState(mirrors=mirrors, caches=caches, last_tokens=last_tokens),
            penalties,
            tokens,
            logprobs,
            plp,
            top,
            accepted,
        )

    # ------------------------------------------------------------------ weights and memory
    def params_of(self, model: CausalLM) -> Any:
        """`model`'s parameters split as this runner holds them (`nnx.split`, or `scan_layers`'
        stacking), not placed: `runtime.weight_update` puts each on its old leaf's sharding."""
        if self._scan is not None:
            return ScannedGraph.split(model, self.layout.layer_groups)[1]
        return nnx.split(model)[1]

    @property
    def param_treedef(self) -> Any:
        """The tree structure of `params` (what an update must reproduce)."""
        return self._param_def

    @property
    def param_abstract(self) -> list[jax.ShapeDtypeStruct]:
        """Shape, dtype and sharding of every parameter leaf: what the executables take."""
        leaves: list[jax.ShapeDtypeStruct] = self._abstract[0]
        return leaves

    def set_param_leaves(self, leaves: list[jax.Array | None]) -> None:
        """Swap in new parameter leaves (None: keep that one); shapes, dtypes and shardings as
        `param_abstract` (checked by `runtime.weight_update`), so no step recompiles."""
        old = self.param_leaves
        self.param_leaves = [o if n is None else n for n, o in zip(leaves, old, strict=True)]
        self.params = jax.tree.unflatten(self._param_def, self.param_leaves)

    def release_params(self) -> None:
        """Drop the references to the parameters (`LLM.sleep(level=2)`); arrays nobody else holds
        (a trainer may share them) are freed. `set_param_leaves` with every leaf restores them."""
        self.param_leaves = [None] * len(self._abstract[0])
        self.params = None

    @property
    def has_state(self) -> bool:
        """Whether the KV pools (device state) exist (False after `release_state`)."""
        return self.state is not None

    def release_state(self) -> int:
        """Free the device state: page pools, page-table mirrors, last tokens, penalty counts
        (`LLM.sleep`). Returns the bytes freed. Pending steps are waited for first."""
        if self.state is None:
            return 0
        arrays = [x for x in jax.tree.leaves((self.state, self.penalties)) if isinstance(x, jax.Array)]
        jax.block_until_ready(arrays)
        freed = sum(x.nbytes for x in arrays if not x.is_deleted())
        for x in arrays:
            if not x.is_deleted():
                x.delete()
        self.state = self.penalties = None  # type: ignore[assignment]
        if self.host_kv is not None:  # the host tier is KV too (the scheduler forgets its keys)
            freed += self.host_kv.release()
        return freed

    def restore_state(self) -> None:
        """Build the device state again (zeroed pools, null-page mirrors), with the shapes and
        shardings the executables were compiled for: waking needs no compile."""
        if self.state is not None:
            return
        if self.host_kv is not None:
            self.host_kv.allocate()
        if self._tp is None:
            self.state, self.penalties = self._make_state(), self._make_penalties()
        else:
            sh = self._abstract[1:]
            self.state = jax.jit(self._make_state, out_shardings=jax.tree.map(lambda a: a.sharding, sh[0]))()
            self.penalties = jax.jit(self._make_penalties, out_shardings=self._tp.replicated)()

    # ------------------------------------------------------------------ host side
    supports_token_mask = True  # `dispatch(ops, token_mask)` (structured outputs)

    @property
    def scan_layers(self) -> bool:
        """Whether runs of identical layers are stacked and scanned (`models.layer_scan`)."""
        return self._scan is not None

    @property
    def scan_runs(self) -> tuple[LayerRun, ...]:
        """The stacked runs of layers under scan_layers (params["runs"][r] is run r); ()."""
        return () if self._scan is None else self._scan.runs

    @property
    def tp(self) -> TensorParallel | None:
        """The tensor-parallel wiring over the runner's mesh; None on the single-device path."""
        return self._tp

    @property
    def buckets(self) -> tuple[int, ...]:
        """The token buckets (`shapes.buckets`)."""
        return self.shapes.buckets

    @property
    def shape_keys(self) -> tuple[tuple[int, int], ...]:
        """Every (token bucket, kv bucket tokens) pair a step can have: one compile each."""
        return self.shapes.shape_keys

    def step_layout(self, shape: StepShape) -> StepLayout:
        """The packing of the input buffers of a step of `shape` (built once per shape)."""
        lay = self._layouts.get(shape)
        if lay is None:
            deltas = tuple(g.delta_width for g in self.layout.groups)
            cols = self.shapes.kv_levels[shape.level][1]
            lay = self._layouts[shape] = layout_for(self.max_batch_requests, shape.bucket, deltas, cols)
        return lay

    def execute(
        self,
        shape: StepShape,
        i32: np.ndarray | jax.Array,
        f32: np.ndarray | jax.Array,
        token_mask: np.ndarray | None = None,
    ) -> StepOutputs:
        """Enqueue the jitted step on packed inputs and return its device outputs at once.

        shape: the step's (token bucket, kv level); i32 int32[L.i32_size], f32 float32[L.f32_size]
        with L = `step_layout(shape)` (`step_inputs.pack`), numpy or already on the devices (under
        tensor parallelism: replicated over the mesh). token_mask: i32[R, ceil(V / 32)] allowed
        tokens per row (None = all). The device state advances to the step's
        output futures. Returns (tokens i32[R], logprobs f32[R], prompt logprobs f32[T_b],
        (top ids i32[R, K], top logprobs f32[R, K]), accepted drafts i32[R]), T_b = the token
        bucket.
        """
        fn = self.programs.get(shape) or self.programs.prepare(shape)
        mask: np.ndarray | jax.Array = self._no_mask if token_mask is None else token_mask
        if token_mask is not None and self._tp is not None:
            mask = jax.device_put(token_mask, self._tp.replicated)
        self.state, self.penalties, tokens, logprobs, plp, top, accepted = fn(
            self.param_leaves, self.state, self.penalties, i32, f32, mask
        )
        return tokens, logprobs, plp, top, accepted

    # ------------------------------------------------------------------ compiling
    def _lower(self, shape: StepShape) -> jax.stages.Lowered:
        """Trace + lower the step for `shape` (abstract arguments: no device work)."""
        lay = self.step_layout(shape)
        i32 = jax.ShapeDtypeStruct((lay.i32_size,), jnp.int32, sharding=self._input_sharding)
        f32 = jax.ShapeDtypeStruct((lay.f32_size,), jnp.float32, sharding=self._input_sharding)
        return self._step.lower(*self._abstract, i32, f32, self._mask_abstract, lay)

    def largest_step_temp_bytes(self) -> int:
        """Device bytes of the temporaries of the largest step (the top token bucket at the
        full kv level), from XLA's `memory_analysis()` of its executable, made ready (compiled,
        or read from the executable store) but not run; 0 where the backend reports nothing.
        The page pool is sized after it (`LLM`: vLLM's profile run, without the run)."""
        shape = StepShape(self.shapes.buckets[-1], len(self.shapes.kv_levels) - 1)
        stats = self.programs.prepare(shape).memory_analysis()
        return int(getattr(stats, "temp_size_in_bytes", 0) or 0) if stats is not None else 0

    def _program_key(self, shape: StepShape) -> str:
        """The executable-store key of the step for `shape`, computed without tracing."""
        program = {
            "model": repr(self.config),
            "groups": repr(self.layout.groups),
            "layer_groups": repr(self.layout.layer_groups),
            "honor_full_refresh": repr(self.layout.honor_full_refresh),
            "step_layout": repr(self.step_layout(shape)),
            "backend": self.backend,
            "speculative": repr(self.num_speculative),
            "scan_layers": repr(None if self._scan is None else self._scan.runs),
            # static in the graph, not in the arguments: int8 and w8a8 weights look alike
            "quantization": repr(self.quantization),
            "kv_cache_dtype": self.kv_cache_dtype,
            "arguments": executables.signature((*self._abstract, self._mask_abstract)),
            "inputs": repr(self._input_sharding),
            "tp": repr(None if self._tp is None else self._tp.mesh),
        }
        return executables.program_key(program, self.programs.devices)

    @property
    def num_loaded(self) -> int:
        """Step shapes read back from the executable store (no trace, no compile)."""
        return int(self.programs.summary()["shapes_loaded"])

    def _run(self, ops: StepOps, shape: StepShape, token_mask: np.ndarray | None = None) -> StepOutputs:
        i32, f32 = pack(ops, self.step_layout(shape))
        if self._tp is not None:
            i32, f32 = jax.device_put((i32, f32), self._tp.replicated)
        # else the numpy buffers go to the jitted call as they are: its C++ dispatch moves them
        # to the device for a fraction of what a Python-level `jax.device_put` costs per step
        return self.execute(shape, i32, f32, token_mask)

    def warmup(
        self, padding_ops: StepOps, max_kv_len: int | None = None, *, workers: int = 2, progress: bool = False
    ) -> int:
        """Make the shape keys (token bucket x kv bucket, `shape_keys`) ready now, so serving does
        not stall on XLA: each is loaded from the executable store or compiled ahead of time,
        `workers` at a time (`step_programs.StepPrograms.prepare_many`; `progress`: a bar). Nothing
        runs on the device, so its state is unchanged. `padding_ops`: the scheduler's all-padding
        StepOps (checked to hold no row).

        Compile policy (`ShapePolicy.warmup_shapes`): None (default) compiles every pair, after
        which serving never compiles. `max_kv_len` = L compiles every token bucket with the kv
        buckets up to the one covering L tokens; a step whose longest row is longer compiles its
        key on first use (once; counted in `num_compiles`, at most `len(shape_keys)` in all;
        `lazy_compile="background"` runs it as a ready covering shape meanwhile). Returns how many
        shapes it made ready (compiled or loaded); 0 when all were ready.
        """
        shapes = self.shapes.warmup_shapes(padding_ops, max_kv_len)
        if self.host_kv is not None:  # the host tier's copy programs too (not counted)
            self.host_kv.warmup()
        return self.programs.prepare_many(shapes, workers=workers, progress=progress)

    def attach_host_tier(self, host_pages: int) -> None:
        """Keep a host KV tier of `host_pages` pages (`runtime.host_tier.HostKVPool`): each step's
        `StepOps.copies` run on the device caches before the step."""
        axis = int(self._scan is not None)  # scan_layers' pools are f[n, P, ...]
        self.host_kv = HostKVPool(self.state.caches, self.layout.num_pages, host_pages, axis)

    def step(self, ops: StepOps) -> StepResult:
        """Applies one `StepOps`; returns the sampled tokens (numpy). Empty steps skip the device."""
        return self.collect(self.dispatch(ops))

    def dispatch(self, ops: StepOps, token_mask: np.ndarray | None = None) -> StepHandle:
        """Enqueue one `StepOps` on the device and return at once (the state advances to the
        step's output futures, so the next dispatch queues behind this one). token_mask:
        i32[R, ceil(V / 32)] allowed tokens of each row (structured outputs; None = all)."""
        if ops.copies is not None:  # host-tier copies first, on the same device queue
            assert self.host_kv is not None, "StepOps with page copies but no host tier"
            caches = self.host_kv.apply(self.state.caches, ops.copies)
            self.state = DeviceState(self.state.mirrors, caches, self.state.last_tokens)
        if ops.num_seqs == 0:
            return StepHandle(None, None, None, 0)
        self.warn_clamped(ops)
        shape = self.shapes.step_shape(ops)
        if self.lazy_compile == "background" and self.programs.get(shape) is None:
            cover = self.programs.cover(shape)  # step_programs: never stall on a compile
            if cover is not None:
                self.programs.prepare_in_background(shape)
                shape = cover
        return self.handle_for(ops, shape.bucket, *self._run(ops, shape, token_mask))

    def warn_clamped(self, ops: StepOps) -> None:
        """`step_inputs.warn_clamped` against this runner's layout."""
        warn_clamped(ops, self.layout)

    def handle_for(
        self,
        ops: StepOps,
        bucket: int,
        tokens: jax.Array,
        logprobs: jax.Array,
        plp: jax.Array | None,
        top: tuple[jax.Array, jax.Array] | None,
        accepted: jax.Array | None = None,
    ) -> StepHandle:
        """Wrap one dispatched step's device outputs; copies back only what the step asked for."""
        for x in (tokens, logprobs):  # start the device->host copies now, not when collected
            x.copy_to_host_async()
        if ops.prompt_targets[: ops.num_tokens].max(initial=-1) < 0:
            plp = None  # no prompt logprobs asked for in this step: nothing to copy back
        if not np.asarray(ops.top_logprobs).any():
            top = None  # copy the [R, K] top-k back only when asked for
        if not ops.draft_lens.any():
            accepted = None  # no drafts in this step: nothing to copy back
        return StepHandle(tokens, logprobs, plp, bucket, top, accepted)

    def collect(self, handle: StepHandle) -> StepResult:
        """Block until a dispatched step is done; its host results. Host-tier saves of the steps
        dispatched so far land in the host pool (their copies ran before their steps)."""
        out = host_results(handle, self.max_batch_requests, self.max_scheduled_tokens)
        if self.host_kv is not None:
            self.host_kv.flush()
        return out

    def host_mirrors(self) -> list[np.ndarray]:
        """The device page-table mirrors after the last dispatched step (blocks; debug checks)."""
        return [np.asarray(m) for m in self.state.mirrors]
