"""Structured outputs: constrained vs unconstrained throughput on the same requests (issue 23).

    python benchmarks/structured.py --model smollm2-135m            # or a Hugging Face dir

Workload: `--prompts` chat requests at once (the `run` job's system prompt, one question each
asking for a JSON record), each constrained by the same JSON schema (nested object, enum,
bounded integers, an array with maxItems, strings with maxLength), greedy. The unconstrained
run sends the same prompts with `max_tokens` = the number of tokens the constrained run wrote
for that request and EOS ignored, so both runs generate the same number of tokens and the
ratio measures the cost of the constraint (masks on the host, the masked sampler, the loop
waiting for each constrained step's tokens), not output lengths. Runs alternate, best of
`--reps`. Prints out tok/s of each, their ratio (target >= 0.9x), and the host time spent
computing masks per constrained step and as a share of the constrained run's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._engine_args import add_engine_args, llm_kwargs  # noqa: E402

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["title", "author", "year", "genre", "tags", "available"],
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {"name": {"type": "string", "maxLength": 30}},
        },
        "year": {"type": "integer", "minimum": 1800, "maximum": 2026},
        "genre": {"enum": ["fiction", "history", "science", "poetry", "other"]},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}},
        "available": {"type": "boolean"},
    },
}
TOPICS = [
    "a mystery novel",
    "a book about Rome",
    "a poetry collection",
    "a physics primer",
    "a cookbook",
    "a travel guide",
    "a biography",
    "a children's book",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, max_batch_requests=32, max_scheduled_tokens=512, max_context_len=1024)
    p.set_defaults(model="smollm2-135m")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sync", action="store_true", help="the synchronous loop (default overlapped)")
    args = p.parse_args()

    from tokenspeed_jax import LLM, SamplingParams
    from tokenspeed_jax.engine.chat_template import render_chat
    from tokenspeed_jax.workloads.chat_prompts import SYSTEM_PROMPT

    llm = LLM(args.model, **llm_kwargs(args, async_scheduling=not args.sync))
    llm.warmup()
    tok = llm.tokenizer
    prompts = [
        render_chat(
            tok,
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": f"Describe {TOPICS[i % len(TOPICS)]} (request {i}) as a JSON "
                    f"record with title, author, year, genre, tags, available.",
                },
            ],
        )
        for i in range(args.prompts)
    ]
    constrained = SamplingParams(max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
    engine = llm.engines[0]
    llm.generate(prompts[:1], constrained)  # warm: tokenizer for llguidance, the matcher path

    def timed(params):
        book = engine._grammars
        m0 = (book.mask_s, book.num_masked_steps) if book is not None else (0.0, 0)
        steps0 = engine.num_steps
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
        book = engine._grammars
        mask_s = book.mask_s - m0[0] if book is not None else 0.0
        masked = book.num_masked_steps - m0[1] if book is not None else 0
        return outs, wall, mask_s, masked, engine.num_steps - steps0

    best = {"constrained": None, "free": None}
    lengths = None
    valid = 0
    for _ in range(args.reps):
        outs, wall, mask_s, masked, steps = timed(constrained)
        n = sum(len(o.token_ids) for o in outs)
        if lengths is None:
            lengths = [len(o.token_ids) for o in outs]
            for o in outs:
                try:
                    json.loads(o.text)
                    valid += o.finish_reason == "stop"
                except ValueError:
                    pass
        if best["constrained"] is None or wall < best["constrained"][0]:
            best["constrained"] = (wall, n, mask_s, masked, steps)
        free = [SamplingParams(max_tokens=k, ignore_eos=True) for k in lengths]
        outs, wall, _, _, steps = timed(free)
        n = sum(len(o.token_ids) for o in outs)
        if best["free"] is None or wall < best["free"][0]:
            best["free"] = (wall, n, 0.0, 0, steps)

    cw, cn, mask_s, masked, csteps = best["constrained"]
    fw, fn, _, _, fsteps = best["free"]
    print(
        f"model {args.model}, {args.prompts} requests, dtype {args.dtype}, "
        f"{'sync' if args.sync else 'overlapped'} loop, best of {args.reps}; "
        f"{valid}/{args.prompts} constrained outputs parse as JSON and ended by the grammar"
    )
    print(
        "| run | out tokens | steps | wall s | out tok/s | mask ms / constrained step | mask share of wall |"
    )
    print("|---|---|---|---|---|---|---|")
    print(f"| unconstrained | {fn} | {fsteps} | {fw:.2f} | {fn / fw:.1f} | - | - |")
    print(
        f"| JSON schema | {cn} | {csteps} | {cw:.2f} | {cn / cw:.1f} | "
        f"{1e3 * mask_s / max(masked, 1):.3f} | {100 * mask_s / cw:.2f}% |"
    )
    print(f"constrained / unconstrained out tok/s: {(cn / cw) / (fn / fw):.2f}x (target >= 0.9x)")


if __name__ == "__main__":
    main()
