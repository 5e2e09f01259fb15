"""Quantized KV cache and weights (issue 26): memory, speed and accuracy side by side, one run.

    python benchmarks/quantization.py [--model smollm2-135m] [--dtypes float32,bfloat16]
        [--configs auto/none,auto/int8,auto/w8a8,auto/q8_0,auto/gguf,int8/none,fp8_e4m3/none]
        [--min-token-bucket N]

Each config `KV/WEIGHTS` (kv_cache_dtype / quantization) builds its own LLM on the same model,
runs the workload once to compile, then times it again:
- batch-1 decode: one chat prompt, 64 greedy tokens (EOS ignored): tok/s (a lone decode runs
  one row by default (the engine's CPU ladder has a 1-token bucket: the weights read once per
  token; `--min-token-bucket 16` runs it on 16);
- batched: 16 chat prompts sharing a system prompt, 32 greedy tokens each: output tok/s;
- memory: resident bytes of the parameters, KV bytes per page, pages per GiB, and how many
  requests of 2048 tokens a 1 GiB pool holds;
- accuracy: prompt logprobs of a fixed text against the first config's (float) run: max and
  mean |diff| in nats, and how many greedy outputs equal the float run's.
Ratios are against the first config of the same dtype, measured in this run.
`--llama-python PY` (a venv with llama-cpp-python, ../shared/peers/llama-cpp.md): llama.cpp's
batch-1 tok/s on the model's own GGUF file (the smollm2-135m alias, or `--model x.gguf`), same
prompt ids, greedy, EOS banned, timed the same way, printed under the table; with "ours /
llama.cpp" for every config of the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tokenspeed_jax import LLM, SamplingParams  # noqa: E402
from tokenspeed_jax.runtime.state import bytes_per_page  # noqa: E402
from tokenspeed_jax.workloads.chat_prompts import QUESTIONS  # noqa: E402

SYSTEM = "You are a concise assistant for a public library help desk. Answer in one or two short sentences."
TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors "
    "can borrow up to ten books at a time, and renew them online for another three weeks."
)
GIB = 1 << 30


def _chat(llm: LLM, question: str) -> list[int]:
    tok = llm.tokenizer
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    if hasattr(tok, "apply_chat_template"):
        return list(tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False))
    return list(tok.encode(SYSTEM + "\n" + question))


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    llm.generate(prompts, params)  # compile / warm the same shapes
    for e in llm.engines:  # shapes the warm pass ran as a covering one meanwhile
        e.runner.programs.wait_background()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, outs


def run_config(
    model: str,
    dtype: str,
    kv: str,
    weights: str | None,
    min_token_bucket: int | None,
    attention_backend: str = "auto",
) -> dict:
    llm = LLM(
        model,
        dtype=dtype,
        kv_cache_dtype=kv,
        quantization=weights,
        page_size=16,
        num_pages=1024,
        max_batch_requests=16,
        max_scheduled_tokens=256,
        max_context_len=512,
        attention_backend=attention_backend,
        min_token_bucket=min_token_bucket,
        lazy_compile="sync",
    )  # the untimed run compiles every shape the timed one uses
    runner = llm.engine.runner
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.params))
    per_page = bytes_per_page(
        llm.engine.runner.config,
        llm.engine.runner.layout.layer_groups,
        llm.engine.runner.layout.page_sizes,
        kv,
    )
    one = [_chat(llm, QUESTIONS[0])]
    s1, out1 = _timed(llm, one, SamplingParams(max_tokens=64, ignore_eos=True))
    batch = [_chat(llm, q) for q in (QUESTIONS * 4)[:16]]
    sb, outb = _timed(llm, batch, SamplingParams(max_tokens=32, ignore_eos=True))
    text = list(llm.tokenizer.encode(TEXT))
    plp = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    return {
        "param_mb": param_bytes / 1e6,
        "page_kb": per_page / 1e3,
        "pages_per_gib": GIB // per_page,
        "requests_2k_per_gib": (GIB // per_page) // (2048 // 16),
        "b1_tok_s": 64 / s1,
        "batch_tok_s": 16 * 32 / sb,
        "b1_prompt": one[0],
        "tokens": [o.token_ids for o in out1 + outb],
        "prompt_logprobs": [x for x in plp.prompt_logprobs if x is not None],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--configs", default="auto/none,auto/int8,auto/w8a8,auto/q8_0,auto/gguf,int8/none,fp8_e4m3/none"
    )
    ap.add_argument("--min-token-bucket", type=int, default=None)
    ap.add_argument(
        "--llama-python",
        default=os.environ.get("LLAMA_PYTHON"),
        help="python of a venv with llama-cpp-python: llama.cpp batch-1 on the GGUF",
    )
    ap.add_argument("--attention-backend", default="auto", help="auto (native on CPU), native, reference")
    args = ap.parse_args()
    print(f"model {args.model}, jax {jax.__version__}, {jax.devices()[0].platform}")
    print(
        "| dtype | kv / weights | params MB | KV page KB | pages per GiB | 2k-token requests "
        "per GiB | batch-1 tok/s | ratio | batch-16 tok/s | ratio | prompt logprob |diff| max "
        "/ mean | greedy outputs equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    b1: list[tuple[str, float]] = []
    prompt: list[int] | None = None
    for dtype in args.dtypes.split(","):
        base: dict | None = None
        for cfg in args.configs.split(","):
            kv, w = cfg.split("/")
            r = run_config(
                args.model,
                dtype,
                kv,
                None if w == "none" else w,
                args.min_token_bucket,
                args.attention_backend,
            )
            base = base or r
            b1.append((f"{dtype} {kv} / {w}", r["b1_tok_s"]))
            prompt = r["b1_prompt"]
            diff = np.abs(np.asarray(r["prompt_logprobs"]) - np.asarray(base["prompt_logprobs"]))
            same = sum(a == b for a, b in zip(r["tokens"], base["tokens"], strict=True))
            print(
                f"| {dtype} | {kv} / {w} | {r['param_mb']:.0f} | {r['page_kb']:.1f} | "
                f"{r['pages_per_gib']} | {r['requests_2k_per_gib']} | {r['b1_tok_s']:.1f} | "
                f"{r['b1_tok_s'] / base['b1_tok_s']:.2f}x | {r['batch_tok_s']:.1f} | "
                f"{r['batch_tok_s'] / base['batch_tok_s']:.2f}x | {diff.max():.3f} / "
                f"{diff.mean():.3f} | {same}/{len(r['tokens'])} |",
                flush=True,
            )
    if args.llama_python and prompt is not None:
        from _llama_cpp import batch1_tok_s  # benchmarks/ is sys.path[0] when run as a script

        from tokenspeed_jax.models import registry

        gguf = registry.resolve_alias(args.model) if args.model in registry.MODEL_ALIASES else args.model
        lcpp = batch1_tok_s(args.llama_python, gguf, prompt, 64) if gguf.endswith(".gguf") else None
        if lcpp is None:
            print(f"\nllama.cpp: not run ({gguf} is not a .gguf, or no llama_cpp in {args.llama_python})")
        else:
            print(
                f"\nllama.cpp batch-1 on {os.path.basename(gguf)} (its own kernels, weights as "
                f"stored): {lcpp:.1f} tok/s"
            )
            print("| ours | batch-1 tok/s | ours / llama.cpp |\n|---|---|---|")
            for name, tps in b1:
                print(f"| {name} | {tps:.1f} | {tps / lcpp:.2f}x |")


if __name__ == "__main__":
    main()
