"""N-gram speculative decoding: tokens/s with and without speculation, same requests (issues 24, 44).

    python benchmarks/spec_decode.py --model smollm2-135m        # or a Hugging Face dir
    python benchmarks/spec_decode.py --policies cost,padding:4   # and the engine before issue 44

Engines on the same checkpoint in one process: the default engine ("off": overlapped loop, the
CPU ladder's 1-token bucket for a lone decode) and one per `--policies` entry with
`speculative_config={"method": "ngram", "num_speculative_tokens": k, ..., "draft_policy": P}`
(synchronous loop, as speculation runs): "cost" (the default policy: a step whose rows propose
nothing runs in the 1-token bucket; drafts take a bigger bucket only when they are expected to
pay for it), "padding" (drafts only in the padding of the bucket the one-token rows occupy, no
1-token bucket: every decode pays for 16 rows; with k = 4, the engine before issue 44),
"always"; "policy:k" gives that engine its own k. k defaults to 15: a lone row's drafts may
fill the 16 bucket (with k = 4 a drafted step that costs ~2.5x a lone decode yields 5 tokens
at most, so the 1.8x target at batch 1 is out of reach by construction).
Workloads, greedy, up to `--max-tokens` new tokens (EOS respected unless `--ignore-eos`):
  - copy: chat prompts asking to repeat or lightly edit a given text (code, a list, prose);
  - chat: the `run` job's everyday questions (little to copy).
Each workload runs at batch 1 (its 8 requests one at a time) and at `--batch` running requests
(`--batch-waves` x batch requests queued at once, each task asked several times with a request
number so prompts differ: finished requests free their slot for waiting ones, so the batch's
wall time is not just its slowest request's). After one untimed pass of everything per engine
(every shape compiled, the "cost" policy's step timings and hit rates warm), `--reps` timed reps
(>= 3), the engines interleaved within each rep in an order that rotates from rep to rep.
Prints the machine line, then per run: out tok/s (wall, prefill included) as the median and the
range over the reps, decode tok/s per request (generated tokens after the first over the time
after the first token; median), the speed-up over "off" (median and range of the per-rep
ratios), the acceptance rate, mean tokens per speculative row, device steps per rep, and whether
every output is token-for-token identical to the engine without speculation. Every output is
checked: a "length" finish has exactly max_tokens tokens, a "stop" one at most that (exactly
max_tokens for all with `--ignore-eos`); a failed check stops the benchmark.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._engine_args import add_engine_args, llm_kwargs  # noqa: E402
from benchmarks._machine import cpu_line  # noqa: E402

CODE = """def moving_average(values, window):
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
    return out"""
LIST = (
    "1. Eggs, a dozen\n2. Whole milk, two litres\n3. Sourdough bread\n4. Butter, unsalted\n"
    "5. Apples, six\n6. Coffee beans, dark roast\n7. Rice, basmati\n8. Olive oil"
)
PROSE = (
    "The library opens at nine in the morning on weekdays. Visitors may borrow up to ten "
    "items for three weeks, and renew them twice online or at the front desk. Children under "
    "twelve need a parent to sign up for a card. Printing costs ten cents a page."
)
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


def _median_range(xs: list[float], fmt: str = "{:.1f}", unit: str = "") -> str:
    """'median (min-max)' of the reps."""
    f = (fmt + unit).format
    return f"{f(statistics.median(xs))} ({f(min(xs))}-{f(max(xs))})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, max_batch_requests=8, max_scheduled_tokens=512, max_context_len=1024)
    p.set_defaults(model="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--ignore-eos", action="store_true", help="every output exactly --max-tokens long")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--k", type=int, default=15, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument(
        "--batch-waves", type=int, default=3, help="requests in the batched run = batch-waves x batch"
    )
    p.add_argument("--batches", default="1,batch", help="which runs: 1, batch or both")
    p.add_argument("--workloads", default="copy,chat")
    p.add_argument(
        "--policies",
        default="cost",
        help="speculative engines to compare, by draft_policy (cost, padding, "
        "always), each optionally ':k' (its own num_speculative_tokens)",
    )
    args = p.parse_args()
    if args.reps < 3:
        p.error("--reps must be >= 3 (the median and range of interleaved reps)")

    from tokenspeed_jax import LLM, SamplingParams
    from tokenspeed_jax.engine.chat_template import render_chat
    from tokenspeed_jax.workloads.chat_prompts import QUESTIONS, SYSTEM_PROMPT

    print(f"CPU: {cpu_line()}")
    policies = [x for x in args.policies.split(",") if x]
    # lazy_compile="sync": the untimed warm pass below compiles exactly the shapes timed later
    engines = {"off": LLM(args.model, **llm_kwargs(args, lazy_compile="sync"))}
    for entry in policies:
        policy, _, k = entry.partition(":")
        spec_cfg = {
            "method": "ngram",
            "num_speculative_tokens": int(k or args.k),
            "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min,
            "draft_policy": policy,
        }
        engines[f"ngram-{policy}" + (f"-k{k}" if k else "")] = LLM(
            args.model, **llm_kwargs(args, speculative_config=spec_cfg, lazy_compile="sync")
        )
    tok = engines["off"].tokenizer

    def copy_prompts(n):
        return [
            render_chat(
                tok,
                [
                    {
                        "role": "user",
                        "content": COPY_TASKS[i % len(COPY_TASKS)]
                        + ("" if i < len(COPY_TASKS) else f"\n\n(Request {i}.)"),
                    }
                ],
            )
            for i in range(n)
        ]

    def chat_prompts(n):
        return [
            render_chat(
                tok,
                [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
                ],
            )
            for i in range(n)
        ]

    many = args.batch_waves * args.batch
    makers = {"copy": copy_prompts, "chat": chat_prompts}
    workloads = {w: (makers[w](len(COPY_TASKS)), makers[w](many)) for w in args.workloads.split(",")}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    sizes = [1 if b == "1" else args.batch for b in args.batches.split(",")]

    def run(name, prompts, batch):
        llm = engines[name]
        s0, steps0 = llm.engines[0].stats(), llm.engines[0].num_steps
        t = time.perf_counter()
        outs = []
        step = 1 if batch == 1 else len(prompts)  # batched: all queued, max_batch_requests run
        for i in range(0, len(prompts), step):
            outs += llm.generate(prompts[i : i + step], params)
        wall = time.perf_counter() - t
        s1 = llm.engines[0].stats()
        for o in outs:  # the run is only comparable if every output is complete
            n = len(o.token_ids)
            ok = (
                n == args.max_tokens
                if o.finish_reason == "length" or args.ignore_eos
                else o.finish_reason == "stop" and 1 <= n <= args.max_tokens
            )
            if not ok:
                raise SystemExit(
                    f"{name}: output {o.request_id} has {n} tokens, finish "
                    f"{o.finish_reason!r} (max_tokens {args.max_tokens})"
                )
        n = sum(len(o.token_ids) for o in outs)
        dec_tokens = sum(len(o.token_ids) - 1 for o in outs)
        dec_time = sum(o.metrics.finish_time - o.metrics.first_token_time for o in outs)
        spec = {
            k: s1.get(k, 0) - s0.get(k, 0)
            for k in ("spec_num_rows", "spec_draft_tokens", "spec_accepted_tokens")
        }
        return dict(
            outs=[o.token_ids for o in outs],
            n=n,
            wall=wall,
            tps=n / wall,
            steps=llm.engines[0].num_steps - steps0,
            decode=dec_tokens / dec_time if dec_time > 0 else 0.0,
            **spec,
        )

    runs = [(w, batch) for w in workloads for batch in sizes]
    for name in engines:  # untimed: every shape compiled, the "cost" estimates warm
        for w, batch in runs:
            few, lots = workloads[w]
            run(name, few if batch == 1 else lots, batch)
    names = list(engines)
    results: dict[tuple[str, int], dict[str, list[dict]]] = {r: {e: [] for e in names} for r in runs}
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for w, batch in runs:
            few, lots = workloads[w]
            for name in order:
                results[(w, batch)][name].append(run(name, few if batch == 1 else lots, batch))

    print(
        f"model {args.model}, dtype {args.dtype}, greedy, up to {args.max_tokens} new tokens"
        f"{' (EOS ignored)' if args.ignore_eos else ''}, ngram k={args.k} lookup "
        f"{args.lookup_min}..{args.lookup_max}, {args.reps} interleaved reps: median (range)"
    )
    print(
        "| workload | batch | engine | out tokens | out tok/s | decode tok/s per request | "
        "speed-up | acceptance | tokens / spec row | steps | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (w, batch), per in results.items():
        off = per["off"]
        for name in names:
            reps = per[name]
            first = reps[0]
            if any(r["outs"] != first["outs"] for r in reps):
                raise SystemExit(f"{name}: outputs differ between reps ({w}, batch {batch})")
            same = sum(a == b for a, b in zip(off[0]["outs"], first["outs"]))
            speed = [r["tps"] / o["tps"] for r, o in zip(reps, off)]
            drafted = sum(r["spec_draft_tokens"] for r in reps)
            accepted = sum(r["spec_accepted_tokens"] for r in reps)
            rows = sum(r["spec_num_rows"] for r in reps)
            spec = name != "off"
            ident = f"{same}/{len(first['outs'])}" if spec else "-"
            steps = statistics.median(r["steps"] for r in reps)
            print(
                f"| {w} | {batch} | {name} | {first['n']} | "
                f"{_median_range([r['tps'] for r in reps])} | "
                f"{statistics.median(r['decode'] for r in reps):.1f} | "
                f"{_median_range(speed, '{:.2f}', 'x')} | "
                f"{f'{accepted / max(drafted, 1):.0%}' if spec else '-'} | "
                f"{f'{(accepted + rows) / max(rows, 1):.2f}' if spec else '-'} | "
                f"{steps:.0f} | {ident} |"
            )
    for name, llm in engines.items():  # what the "cost" policy weighed its buckets by, at the end
        costs = llm.engines[0].scheduler.step_costs
        if costs is not None:
            ms = ", ".join(f"{b}: {1e3 * s:.1f}" for b, s in sorted(costs.measured().items()))
            print(f"\n{name}: decode step ms by token bucket (median of the last timed) {ms}")


if __name__ == "__main__":
    main()
