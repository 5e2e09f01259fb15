"""N-gram speculative decoding: tokens/s with and without speculation, same requests (issue 24).

    python benchmarks/spec_decode.py --model smollm2-135m        # or a Hugging Face dir

Two engines on the same checkpoint in one process: the default engine (overlapped loop) and one
with `speculative_config={"method": "ngram", "num_speculative_tokens": k, ...}` (synchronous
loop, as speculation runs). Workloads, greedy, up to `--max-tokens` new tokens, EOS respected:
  - copy: chat prompts asking to repeat or lightly edit a given text (code, a list, prose);
  - chat: the `run` job's everyday questions (little to copy).
Each workload runs at batch 1 (its 8 requests one at a time) and at `--batch` running requests
(`--batch-waves` x batch requests queued at once, each task asked several times with a request
number so prompts differ: finished requests free their slot for waiting ones, so the batch's
wall time is not just its slowest request's); runs alternate between the engines, best of
`--reps`. Prints out tok/s (wall, prefill included),
decode tok/s per request (generated tokens after the first over the time after the first token),
the speed-up, the acceptance rate, mean tokens per speculative row, and whether every output is
token-for-token identical to the engine without speculation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._engine_args import add_engine_args, llm_kwargs  # noqa: E402

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    out = []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out'''
LIST = ("1. Eggs, a dozen\n2. Whole milk, two litres\n3. Sourdough bread\n4. Butter, unsalted\n"
        "5. Apples, six\n6. Coffee beans, dark roast\n7. Rice, basmati\n8. Olive oil")
PROSE = ("The library opens at nine in the morning on weekdays. Visitors may borrow up to ten "
         "items for three weeks, and renew them twice online or at the front desk. Children under "
         "twelve need a parent to sign up for a card. Printing costs ten cents a page.")
COPY_TASKS = [
    f"Repeat the following Python function exactly, without any comment:\n\n{CODE}",
    f"Rename the function to rolling_mean and otherwise repeat it exactly:\n\n{CODE}",
    f"Copy this shopping list exactly:\n\n{LIST}",
    f"Repeat this shopping list, but write every item in lowercase:\n\n{LIST}",
    f"Repeat this notice word for word:\n\n{PROSE}",
    f"Repeat this notice, replacing 'library' with 'museum':\n\n{PROSE}",
    f"Quote the code below exactly:\n\n{CODE}",
    f"Write this list again exactly as given:\n\n{LIST}",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, max_batch_requests=8, max_scheduled_tokens=512, max_context_len=1024)
    p.set_defaults(model="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--batch-waves", type=int, default=3,
                   help="requests in the batched run = batch-waves x batch")
    p.add_argument("--batches", default="1,batch", help="which runs: 1, batch or both")
    p.add_argument("--no-padding-only", action="store_true",
                   help="up to k drafts per row whatever the token bucket (padding_only=False)")
    args = p.parse_args()

    from tokenspeed_jax import LLM, SamplingParams
    from tokenspeed_jax.engine.chat_template import render_chat
    from tokenspeed_jax.workloads.chat_prompts import QUESTIONS, SYSTEM_PROMPT

    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    if args.no_padding_only:
        spec_cfg["padding_only"] = False
    # lazy_compile="sync": the untimed warm runs below compile exactly the shapes timed later
    engines = {"off": LLM(args.model, **llm_kwargs(args, lazy_compile="sync")),
               "ngram": LLM(args.model, **llm_kwargs(args, speculative_config=spec_cfg,
                                                     lazy_compile="sync"))}
    tok = engines["off"].tokenizer
    def copy_prompts(n):
        return [render_chat(tok, [{"role": "user", "content": COPY_TASKS[i % len(COPY_TASKS)]
                                   + ("" if i < len(COPY_TASKS) else f"\n\n(Request {i}.)")}])
                for i in range(n)]

    def chat_prompts(n):
        return [render_chat(tok, [{"role": "system", "content": SYSTEM_PROMPT},
                                  {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
                for i in range(n)]

    many = args.batch_waves * args.batch
    copy, chat = copy_prompts(len(COPY_TASKS)), chat_prompts(len(COPY_TASKS))
    workloads = {"copy": (copy, copy_prompts(many)), "chat": (chat, chat_prompts(many))}
    params = SamplingParams(max_tokens=args.max_tokens)
    for llm in engines.values():  # warm every shape both workloads reach, at both batch sizes
        for few, lots in workloads.values():
            llm.generate(few[:1], params)
            llm.generate(lots, params)

    def run(name, prompts, batch):
        llm = engines[name]
        s0 = llm.engines[0].stats()
        t = time.perf_counter()
        outs = []
        step = 1 if batch == 1 else len(prompts)  # batched: all queued, max_batch_requests run
        for i in range(0, len(prompts), step):
            outs += llm.generate(prompts[i:i + step], params)
        wall = time.perf_counter() - t
        s1 = llm.engines[0].stats()
        n = sum(len(o.token_ids) for o in outs)
        dec_tokens = sum(len(o.token_ids) - 1 for o in outs)
        dec_time = sum(o.metrics.finish_time - o.metrics.first_token_time for o in outs)
        spec = {k: s1.get(k, 0) - s0.get(k, 0)
                for k in ("spec_num_rows", "spec_draft_tokens", "spec_accepted_tokens")}
        return dict(outs=[o.token_ids for o in outs], n=n, wall=wall,
                    decode=dec_tokens / dec_time if dec_time > 0 else 0.0, **spec)

    print(f"model {args.model}, dtype {args.dtype}, greedy, up to {args.max_tokens} new tokens, "
          f"ngram k={args.k} lookup {args.lookup_min}..{args.lookup_max} padding_only="
          f"{not args.no_padding_only}, best of {args.reps}")
    print("| workload | batch | spec | out tokens | out tok/s | decode tok/s per request | "
          "speed-up | acceptance | tokens / spec row | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sizes = [1 if b == "1" else args.batch for b in args.batches.split(",")]
    for wname, (few, lots) in workloads.items():
        for batch in sizes:
            prompts = few if batch == 1 else lots
            best: dict[str, dict] = {}
            for _ in range(args.reps):
                for name in engines:
                    r = run(name, prompts, batch)
                    if name not in best or r["wall"] < best[name]["wall"]:
                        best[name] = r
            off, on = best["off"], best["ngram"]
            same = sum(a == b for a, b in zip(off["outs"], on["outs"]))
            for name, r in best.items():
                rate = r["spec_accepted_tokens"] / max(r["spec_draft_tokens"], 1)
                per_row = (r["spec_accepted_tokens"] + r["spec_num_rows"]) / max(r["spec_num_rows"], 1)
                speed = (r["n"] / r["wall"]) / (off["n"] / off["wall"])
                print(f"| {wname} | {batch} | {name} | {r['n']} | {r['n'] / r['wall']:.1f} | "
                      f"{r['decode']:.1f} | {speed:.2f}x | "
                      f"{'-' if name == 'off' else f'{rate:.0%}'} | "
                      f"{'-' if name == 'off' else f'{per_row:.2f}'} | "
                      f"{'-' if name == 'off' else f'{same}/{len(prompts)}'} |")


if __name__ == "__main__":
    main()
