"""Pieces every subcommand shares: the argument parser, the engine / workload / parallel flags
(each defined once), and building the `LLM` after the cheap checks (`cli.checks`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from tokenspeed_jax.cli.checks import int_at_least, preflight
from tokenspeed_jax.distributed.launch import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    DistributedConfig,
)
from tokenspeed_jax.engine_args import EngineArgs, add_cli_args, from_cli
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
    """Every engine option as a flag (`engine_args.add_cli_args`: the CLI's own defaults are
    `engine_args.CLI_DEFAULTS`; `num_pages` is this command's pool, None = sized from memory),
    then the multi-process flags."""
    add_cli_args(p, num_pages=num_pages)
    add_distributed_args(p)  # multi-process launch (docs/distributed.md)


def add_workload_args(
    p: argparse.ArgumentParser, *, sessions: int, turns: int, system_tokens: int, sessions_help: str
) -> None:
    """The agentic workload's shape flags (`run` and `bench serve`; their defaults differ)."""
    p.add_argument("--sessions", type=int_at_least(1), default=sessions, help=sessions_help)
    p.add_argument("--turns", type=int_at_least(1), default=turns, help="turns per session")
    p.add_argument(
        "--system-tokens", type=int_at_least(0), default=system_tokens, help="shared system prompt tokens"
    )
    p.add_argument("--user-tokens", type=int_at_least(1), default=24, help="tokens per user turn")
    p.add_argument("--max-tokens", type=int_at_least(1), default=24, help="tokens per reply")


def workload_config(args: argparse.Namespace, **more: Any) -> WorkloadConfig:
    """The `WorkloadConfig` of the `add_workload_args` flags and --seed (+ `more` fields)."""
    return WorkloadConfig(
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
        **more,
    )


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` of a command's flags (ValueError for values only the record checks)."""
    return from_cli(args, distributed=distributed_config(args))


def make_llm(args):
    from tokenspeed_jax.llm import LLM

    record = engine_args(args)
    return LLM(record.model, **record.llm_options())


def startup_line(llm) -> str:
    """One line of where start-up went (`LLM.startup_stats`): load, then the step shapes made
    ready: compiled (trace + lowering, XLA; seconds summed over the compile threads) and loaded
    from the executable cache."""
    st = llm.startup_stats()
    return (
        f"start-up: load {st['load_s']:.1f}s, warm-up {st.get('warmup_s', 0.0):.1f}s: "
        f"{st.get('shapes_ready', 0)} step shapes ready, "
        f"{st.get('shapes_compiled', 0)} compiled (trace {st.get('trace_s', 0.0):.1f}s + "
        f"XLA {st.get('compile_s', 0.0):.1f}s), {st.get('shapes_loaded', 0)} loaded from the "
        f"executable cache ({st.get('load_exe_s', 0.0):.1f}s)"
    )


def checked_llm(args, longest_request: int | None):
    """(llm, None) or (None, exit status) after printing one error line; the cheap checks run
    before any weights load."""
    try:
        record = engine_args(args)
    except ValueError as e:
        return None, fail(str(e))
    problem = preflight(record, longest_request=longest_request)
    if problem is not None:
        return None, fail(problem)
    from tokenspeed_jax.llm import LLM

    try:
        return LLM(record.model, **record.llm_options()), None
    except ValueError as e:
        return None, fail(str(e))


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """The multi-process launch flags of `run`, `serve`, `chat` (the parallel sizes are engine
    options)."""
    g = p.add_argument_group("multi-process (one process per host; see docs/distributed.md)")
    g.add_argument(
        "--coordinator",
        default=None,
        help=f"HOST:PORT of process 0's coordination service (env {ENV_COORDINATOR})",
    )
    g.add_argument(
        "--num-processes", type=int, default=None, help=f"processes in the run (env {ENV_NUM_PROCESSES})"
    )
    g.add_argument(
        "--process-id", type=int, default=None, help=f"this process, 0 = leader (env {ENV_PROCESS_ID})"
    )
    g.add_argument(
        "--follower-timeout",
        type=float,
        default=30.0,
        help="seconds without a follower heartbeat before the leader fails",
    )


def distributed_config(args: argparse.Namespace) -> DistributedConfig | None:
    """DistributedConfig from `add_distributed_args` flags over the environment; None = one
    process."""
    cfg = DistributedConfig.from_env(
        coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
    )
    if cfg is not None:
        cfg = dataclasses.replace(cfg, follower_timeout_s=args.follower_timeout)
    return cfg


def follow(llm: Any) -> int:
    """`run` / `serve` on a follower process: replay the leader's steps until it shuts down."""
    print(
        f"tokenspeed-jax: process {llm.distributed.process_id} of "
        f"{llm.distributed.num_processes} following the leader",
        flush=True,
    )
    steps = llm.run_follower()
    print(f"tokenspeed-jax: leader shut down after {steps} steps; exiting", flush=True)
    return 0
