"""Batch-1 decode against the memory-read bound (issues 22, 44), interleaved reps.

    python benchmarks/batch1.py --model /path/to/smollm2-hf [--dtypes float32,bfloat16]
                                [--buckets default,16] [--prompts 6] [--max-tokens 64] [--reps 3]

A lone request decodes one token per step, and each step must read every weight once plus the
K and V of every token its attention layers attend to. The bound on tokens per second is the
machine's read bandwidth over those bytes: bandwidth measured with every core reading (a
read-only max-reduction over `--bandwidth-mib` (1024) MiB, far above the L3, split across one
numpy thread per core, best of 5; taken before and after the runs, the higher kept), bytes
counted per decode step (weights, an untied embedding table excepted since one row of it is
read, + 2 x KV heads x head_dim x itemsize x the tokens each attention layer attends to).

Configurations: each dtype x each `min_token_bucket` ("default": the engine's, whose CPU ladder
has a 1-token bucket for a lone decode; 16: a lone decode runs the model on 16 rows), each in
its own long-lived process (benchmarks/_peer.py): `--prompts` chat prompts, their first
prefills, then one untimed pass (a cached prompt's last partial page is a short prefill of
another token bucket; a shape compiled lazily on a background thread must be done before
timing). Then `--reps` (3) rounds, every configuration one timed pass per round, one at a time
(the others' processes stopped):
the prompts one at a time (`--max-tokens` greedy tokens each, EOS ignored, every output checked
to have exactly that many), decode time = each request's time minus that of a one-token request
of the same prompt. Prints decode tok/s median (min-max), the bound and the share of it
reached. A rep above 100% of the bound fails the benchmark (exit status 1): the bound is then
wrong (too few bytes counted, or the bandwidth measured low on a busy machine).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # _peer / _machine, also when imported by tests

import numpy as np  # noqa: E402
from _machine import cpu_line  # noqa: E402
from _peer import CHILD_IO, EngineChild, check_lengths, interleave, med_range, ours_env  # noqa: E402

SYSTEM = "You are a concise assistant for a public library help desk. Answer in one or two short sentences."

# One configuration per process (_peer.CHILD_IO's protocol): argv[1] = JSON {model, dtype,
# bucket, prompts, max_tokens, backend, system}. READY {weight_bytes, kv_token_bytes, windows,
# prompt_lens}; then per command: RESULT {decode_s, lens} of one timed pass.
_CHILD = (
    CHILD_IO
    + r'''
import time

import jax

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.workloads.chat_prompts import ChatPrompts


def read_bytes(runner):
    """(weight bytes a decode step reads, K+V bytes per attended token per attention layer,
    each attention layer's window or None)."""
    leaves = [(jax.tree_util.keystr(p), x) for p, x in
              jax.tree_util.tree_flatten_with_path(runner.params)[0]]
    untied = any("lm_head" in k for k, _ in leaves)
    # an untied embedding table is read one row per token: not a weight read per step
    weights = sum(x.nbytes for k, x in leaves if not (untied and "embed_tokens" in k))
    cfg = runner.config
    itemsize = jax.numpy.dtype(cfg.dtype).itemsize  # K/V pages in the model dtype (auto)
    layers = [i for i, t in enumerate(cfg.layer_types) if "attention" in t]
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return weights, [per_token] * len(layers), [cfg.window_of(i) for i in layers]


def main():
    out = channel()
    kw = json.loads(open(sys.argv[1]).read())
    llm = LLM(kw["model"], dtype=kw["dtype"], min_token_bucket=kw["bucket"],
              max_batch_requests=8, max_scheduled_tokens=256, max_context_len=2048,
              attention_backend=kw["backend"], compile_cache_dir=False)
    chats = ChatPrompts(llm.tokenizer, system=kw["system"])
    prompts = [chats.first(i) for i in range(kw["prompts"])]
    sp = SamplingParams(max_tokens=kw["max_tokens"], ignore_eos=True)
    for p in prompts:  # the prompts' first prefills
        llm.generate([p], sp)

    def timed_pass():
        """decode time = a full request minus a one-token request of the same prompt (both find
        the prompt in the prefix cache): what is left is max_tokens - 1 decode steps."""
        decode_s, lens = 0.0, []
        for p in prompts:
            t0 = time.perf_counter()
            llm.generate([p], SamplingParams(max_tokens=1, ignore_eos=True))
            t1 = time.perf_counter()
            o = llm.generate([p], sp)[0]
            decode_s += time.perf_counter() - t1 - (t1 - t0)
            lens.append(len(o.token_ids))
        return decode_s, lens

    # once untimed: a cached prompt's last partial page is a short prefill, another token bucket
    # than the first pass used. A lazily compiled shape runs as a covering one while its own
    # compiles on a background thread, which must not share the 2 cores with the timed pass
    # (reading 28.4 tok/s for 35.7, and single requests 2x slower)
    timed_pass()
    llm.engine.runner.programs.wait_background()
    weights, kv, windows = read_bytes(llm.engine.runner)
    send(out, "READY", {"weight_bytes": weights, "kv_token_bytes": kv, "windows": windows,
                        "prompt_lens": [len(p) for p in prompts]})
    for _ in commands():
        decode_s, lens = timed_pass()
        send(out, "RESULT", {"decode_s": decode_s, "lens": lens})


main()
'''
)


def read_bandwidth(nbytes: int, threads: int, rounds: int = 5) -> float:
    """Bytes per second read by `threads` numpy threads, each a max-reduction (SIMD, read only:
    nothing written back) over its share of one `nbytes` buffer; best of `rounds`. numpy drops
    the GIL inside the reduction, so the threads read at once."""
    buf = np.ones(nbytes // 8, np.int64)
    parts = np.array_split(buf, threads)
    best = float("inf")
    for _ in range(rounds):
        workers = [threading.Thread(target=np.max, args=(part,)) for part in parts]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best


def bytes_per_pass(
    weight_bytes: int,
    kv_token_bytes: Sequence[int],
    windows: Sequence[int | None],
    prompt_lens: Sequence[int],
    max_tokens: int,
) -> int:
    """The least a timed pass reads: decode step i (1 .. max_tokens - 1) of a prompt of n ids
    attends to n + i tokens (its own included) and reads every weight once plus, per attention
    layer, the K and V of the tokens it attends to (at most its window)."""
    total = 0
    for n in prompt_lens:
        for i in range(1, max_tokens):
            ctx = n + i
            total += weight_bytes + sum(
                b * (ctx if w is None else min(ctx, w)) for b, w in zip(kv_token_bytes, windows)
            )
    return total


def over_bound(shares: dict[str, list[float]]) -> list[str]:
    """The configurations with a rep above 100% of the bound, described."""
    return [f"{name}: {max(s):.0%} of the bound" for name, s in shares.items() if max(s) > 1.0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument(
        "--buckets", default="default,16", help="min_token_bucket values to compare (default: the engine's)"
    )
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="timed rounds, every configuration once")
    p.add_argument(
        "--bandwidth-mib",
        type=int,
        default=1024,
        help="buffer of the read-bandwidth measurement (far above the L3)",
    )
    p.add_argument("--attention-backend", default="auto", help="auto (native on CPU), native, reference")
    args = p.parse_args()
    print(f"CPU: {cpu_line()}", flush=True)
    cores = os.cpu_count() or 1
    bw_before = read_bandwidth(args.bandwidth_mib << 20, cores)
    print(f"read bandwidth, {cores} threads: {bw_before / 1e9:.1f} GB/s", flush=True)
    configs = [
        (dtype, None if b == "default" else int(b))
        for dtype in args.dtypes.split(",")
        for b in args.buckets.split(",")
    ]
    names = [f"{dtype} bucket={b or 'default'}" for dtype, b in configs]
    base = dict(
        model=os.path.abspath(args.model),
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        backend=args.attention_backend,
        system=SYSTEM,
    )
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        children: dict[str, EngineChild] = {}
        for name, (dtype, bucket) in zip(names, configs):
            children[name] = stack.enter_context(
                EngineChild(
                    name, sys.executable, _CHILD, dict(base, dtype=dtype, bucket=bucket), ours_env(), d
                )
            )
            print(f"{name}: ready in {children[name].ready_s:.1f} s", flush=True)
        res = interleave(names, args.reps, lambda n, r: children[n].ask({}), lambda n: children[n].pid)
        info = {n: c.info for n, c in children.items()}
    bw_after = read_bandwidth(args.bandwidth_mib << 20, cores)
    bw = max(bw_before, bw_after)  # a bound: the best the machine showed
    rows, shares = [], {}
    for name in names:
        check_lengths(name, [n for r in res[name] for n in r["lens"]], args.max_tokens)
        i = info[name]
        tokens = len(i["prompt_lens"]) * (args.max_tokens - 1)
        nbytes = bytes_per_pass(
            i["weight_bytes"], i["kv_token_bytes"], i["windows"], i["prompt_lens"], args.max_tokens
        )
        bound = bw * tokens / nbytes
        tok_s = [tokens / r["decode_s"] for r in res[name]]
        shares[name] = [t / bound for t in tok_s]
        rows.append(
            f"| {name} | {med_range(tok_s)} | {i['weight_bytes'] / 1e6:.0f} | "
            f"{(nbytes / tokens - i['weight_bytes']) / 1e6:.2f} | {bound:.1f} | "
            f"{statistics.median(shares[name]):.0%} ({min(shares[name]):.0%}-"
            f"{max(shares[name]):.0%}) |"
        )
    print(
        f"\n## batch-1 decode: {args.model}, {args.prompts} chat prompts one at a time, "
        f"{args.max_tokens} tokens each (all checked), {args.reps} interleaved reps, median "
        f"(min-max)\n\nCPU: {cpu_line()}; read bandwidth ({cores} threads, read-only) "
        f"{bw_before / 1e9:.1f} GB/s before, {bw_after / 1e9:.1f} after: bound at "
        f"{bw / 1e9:.1f}\n"
    )
    print(
        "| config | decode tok/s | weight MB read per token | KV MB read per token (mean) | "
        "read bound tok/s | share of bound |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if bad := over_bound(shares):
        raise SystemExit(
            "over 100% of the read bound, so the bound is wrong (bytes undercounted "
            "or the bandwidth measured low on a busy machine): " + "; ".join(bad)
        )


if __name__ == "__main__":
    main()
