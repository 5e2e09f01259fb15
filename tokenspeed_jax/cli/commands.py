"""`tokenspeed-jax` command line: run (the main job), serve (OpenAI-compatible HTTP), warmup (fill
the compilation cache), chat, bench.

Bad arguments print one `error:` line and exit with status 2 before any weights load
(`cli.checks`); every flag's help shows its real default."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import runpy
import sys
import time

from tokenspeed_jax.cli.checks import float_at_least, int_at_least, port, preflight
from tokenspeed_jax.cli.common import (
    HelpFormatter,
    Parser,
    add_engine_args,
    add_workload_args,
    checked_llm,
    fail,
    follow,
    make_llm,
    startup_line,
    workload_config,
)

# = tokenspeed_jax.server.limits.DEFAULT_MAX_REQUEST_BYTES and server.drain.DEFAULT_SHUTDOWN_GRACE_S
# (not imported: fastapi is optional)
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 30.0

BENCHMARKS = (
    "cache_core",
    "scheduler",
    "runtime",
    "kernels",
    "serve",
    "overlap",
    "startup",
    "shape_ladder",
    "scan_layers",
    "vs_vllm",
    "step_profile",
    "soak",
)


def cmd_run(args) -> int:
    from tokenspeed_jax.workloads.agentic import run_workload

    wl = workload_config(args, temperature=args.temperature)
    longest = wl.longest_request
    t0 = time.perf_counter()
    llm, status = checked_llm(args, longest)
    if llm is None:
        return status
    if not llm.is_leader:
        return follow(llm)
    load_s = time.perf_counter() - t0
    print(
        f"tokenspeed-jax run: model={args.model} sessions={wl.sessions} turns={wl.turns} "
        f"system_prompt={wl.system_tokens} tokens, pages={llm.stats()['total_pages']} "
        f"replicas={len(llm.engines)} "
        f"loop={'async' if llm.engine.async_scheduling else 'sync'} "
        f"compile_cache={llm.compile_cache_dir or 'off'} "
        f"(loaded in {load_s:.1f}s)",
        flush=True,
    )
    from tokenspeed_jax.workloads.chat_prompts import prompt_source_for

    text = prompt_source_for(llm.tokenizer)  # real chat-templated text when the model has a template
    t1 = time.perf_counter()
    # Synthetic prompts have known lengths: compile only the kv buckets they can reach. Real text
    # has not been tokenized yet, so every shape is compiled.
    ready = llm.warmup(max_kv_len=longest if text is None else None, progress=not args.no_progress)
    print(
        f"{ready} step shapes ready in {time.perf_counter() - t1:.1f}s (before serving, so "
        f"latencies below exclude XLA compilation)\n{startup_line(llm)}",
        flush=True,
    )
    vocab = min(256, llm.model_config.vocab_size)
    if text is not None:
        wl = dataclasses.replace(wl, ignore_eos=False)
        print(
            f"workload: real text through the model's chat template (first prompt "
            f"{len(text.first(0))} tokens, shared system prompt), replies stop at EOS",
            flush=True,
        )
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


def cmd_warmup(args) -> int:
    """Compile every step shape of this engine configuration into the persistent compilation
    cache, so the next `run` / `serve` with the same flags starts warm."""
    from tokenspeed_jax.runtime import compile_cache

    if args.compile_cache_dir is False:
        return fail("warmup fills the compilation cache: drop --no-compile-cache")
    t0 = time.perf_counter()
    llm, status = checked_llm(args, None)
    if llm is None:
        return status
    if not llm.is_leader:
        return follow(llm)
    if llm.compile_cache_dir is None:
        return fail("no writable compilation cache dir (see the warning above); pass --compile-cache-dir DIR")
    load_s = time.perf_counter() - t0
    store = llm.executable_store
    before = store.num_entries() if store is not None else 0
    t1 = time.perf_counter()
    shapes = llm.warmup(progress=True)
    wall = time.perf_counter() - t1
    for rec in llm.startup_stats()["shapes"]:
        print(
            f"  shape tokens={rec['bucket']:<5} kv_level={rec['level']} {rec['source']:<8} "
            f"trace {rec['trace_s']:5.1f}s  XLA {rec['compile_s']:5.1f}s  "
            f"read {rec['load_s']:4.2f}s"
        )
    after = store.num_entries() if store is not None else 0
    print(
        f"tokenspeed-jax warmup: model={args.model} {shapes} step shapes in {wall:.1f}s "
        f"(loaded in {load_s:.1f}s); executables {store.root if store else '-'}: {after} "
        f"entries ({after - before} new); XLA cache {llm.compile_cache_dir}: "
        f"{compile_cache.num_entries(llm.compile_cache_dir)} entries\n{startup_line(llm)}",
        flush=True,
    )
    return 0


def cmd_chat(args) -> int:
    from tokenspeed_jax.cli.chat import chat_repl

    llm = make_llm(args)
    print(f"tokenspeed-jax chat: model={args.model} (/reset: new conversation, /exit: quit)", flush=True)
    chat_repl(
        llm, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    return 0


def cmd_serve(args) -> int:
    # The cheap argument checks run first, so a bad flag is reported as such even without the
    # 'serve' extra; the extra is checked before any weights load.
    problem = preflight(args, longest_request=None)
    if problem is not None:
        return fail(problem)
    try:
        from tokenspeed_jax.server import drain
        from tokenspeed_jax.server.app import build_app
    except ImportError as e:
        return fail(f"serve needs the 'serve' extra (pip install -e '.[serve]'): {e}")
    llm, status = checked_llm(args, None)
    if llm is None:
        return status
    if not llm.is_leader:
        return follow(llm)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from tokenspeed_jax.server.auth import resolve_keys

    keys = resolve_keys(args.api_key)
    # the count only: keys never reach a log
    logging.getLogger("tokenspeed_jax.server").info(
        "authentication: %s", f"{len(keys)} API key(s) required" if keys else "off (no --api-key)"
    )
    app = build_app(
        llm,
        model_name=args.served_model_name or args.model,
        api_keys=keys,
        metrics_require_key=args.metrics_require_key,
        max_request_bytes=args.max_request_bytes,
        max_queued_requests=args.max_queued_requests,
        request_timeout_s=args.request_timeout_s,
        shutdown_grace_s=args.shutdown_grace_s,
    )
    drain.serve(app, args.host, args.port)  # returns once SIGTERM / Ctrl-C has drained it
    return 0


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags: address, model id, authentication, request limits,
    shutdown."""
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=8000, help="port to listen on")
    serve.add_argument(
        "--served-model-name", default=None, help="model id clients must send (default: --model)"
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(repeatable: any of the keys; default: $TOKENSPEED_JAX_API_KEY, "
        "else no authentication)",
    )
    serve.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="/metrics and /stats need the key too (default: open)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int_at_least(1),
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 before they are parsed",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int_at_least(0),
        default=None,
        help="503 + Retry-After for new requests while this many wait in the "
        "engine's queue (default: unlimited)",
    )
    serve.add_argument(
        "--request-timeout-s",
        type=float_at_least(0.001),
        default=None,
        help="abort a request not finished after this many seconds: 504, or a "
        "final error event when streaming (default: no limit)",
    )
    serve.add_argument(
        "--shutdown-grace-s",
        type=float_at_least(0.0),
        default=DEFAULT_SHUTDOWN_GRACE_S,
        help="on SIGTERM / Ctrl-C: refuse new requests (503), give those in "
        "flight this long to finish, abort the rest, exit 0",
    )


def cmd_bench(args) -> int:
    if args.name == "serve":
        from tokenspeed_jax.cli.bench_serve import main as bench_serve

        return bench_serve(args.rest)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "benchmarks", f"{args.name}.py")
    if not os.path.exists(path):
        print(f"benchmark script {path} not found (benchmarks live in the source checkout)", file=sys.stderr)
        return 2
    sys.argv = [path, *args.rest]
    runpy.run_path(path, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    fmt = HelpFormatter
    parser = Parser(prog="tokenspeed-jax", formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    run = sub.add_parser(
        "run", help="serve a synthetic agentic workload on the default model", formatter_class=fmt
    )
    add_engine_args(run, num_pages=1024)
    add_workload_args(run, sessions=64, turns=4, system_tokens=384, sessions_help="concurrent sessions")
    run.add_argument(
        "--temperature", type=float_at_least(0.0), default=0.0, help="sampling temperature (0 = greedy)"
    )
    run.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run)

    warm = sub.add_parser(
        "warmup",
        help="compile every step shape into the persistent "
        "compilation cache (later run / serve with the same flags start warm)",
        formatter_class=fmt,
    )
    add_engine_args(warm, num_pages=None)
    warm.set_defaults(func=cmd_warmup)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=fmt)
    add_engine_args(serve, num_pages=None)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser(
        "chat", help="interactive chat over the model's chat template (streams tokens)", formatter_class=fmt
    )
    add_engine_args(chat, num_pages=512)
    chat.add_argument("--system", default=None, help="system prompt (default: the template's own)")
    chat.add_argument("--max-tokens", type=int_at_least(1), default=256, help="tokens per reply")
    chat.add_argument(
        "--temperature", type=float_at_least(0.0), default=0.7, help="sampling temperature (0 = greedy)"
    )
    chat.add_argument("--top-p", type=float_at_least(0.0), default=0.9, help="nucleus mass")
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark (prints a table); 'bench serve' loads an OpenAI server",
        formatter_class=fmt,
    )
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
