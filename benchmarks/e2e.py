"""End to end, ours vs transformers, in one run on the same prompts (issue 11).

    python benchmarks/e2e.py                     # Qwen3-style random checkpoint (a few minutes)
    python benchmarks/e2e.py --quick             # smoke: fewer requests / tokens
    python benchmarks/e2e.py --ctx-table         # + decode-step time at max_context_len 2k/8k/32k
    python benchmarks/e2e.py --model smollm2-135m   # a GGUF real model (needs the GGUF loader)
    python benchmarks/e2e.py --model DIR          # any local HF checkpoint directory

Workload (the issue's): R requests (48) sharing a 384-token prompt plus 32 own tokens each, 48
greedy new tokens each (EOS ignored), float32, on `--threads` CPU threads (2) for both sides.
- ours: `LLM(model=DIR)`, `llm.warmup()` (compiles first, untimed), then one timed
  `llm.generate(prompts)` (continuous batching + prefix cache);
- transformers: `AutoModelForCausalLM.from_pretrained(DIR)` and one timed padded static-batch
  `model.generate(input_ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)`.
tokens/s = generated tokens / wall seconds; "greedy equal" = requests whose 48 ids match exactly.

The random checkpoint is written by transformers `save_pretrained` into a temp dir: Qwen3 with
hidden 256, 4 layers, 4 q / 2 kv heads of 64, MLP 768, vocab `--vocab` (32768), init std 0.1
(peaked enough that greedy argmax is not a coin toss between two float implementations).

--ctx-table: the same requests (450 tokens each: prompt 416 + 34 decoded) at max_context_len
2k / 8k / 32k: median device step time of the all-decode steps. Work must follow the real context
(kv-length buckets), so the column should be flat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

# `python benchmarks/e2e.py` puts benchmarks/ first on sys.path, where scheduler.py (the scheduler
# benchmark) would shadow the `scheduler` package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))  # this checkout's packages, not another install's

import numpy as np  # noqa: E402

GGUF_MODELS = {"smollm2-135m"}  # resolved by tokenspeed_jax's GGUF support (issue 10)


def write_random_qwen3(path: str, *, vocab: int, seed: int = 0) -> None:
    import torch
    import transformers as tr

    torch.manual_seed(seed)
    cfg = tr.Qwen3Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.1,
        max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)  # fmt: skip
    model = tr.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path)


def make_prompts(n: int, shared: int, own: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, shared).tolist()
    return [prefix + rng.integers(3, vocab, own).tolist() for _ in range(n)]


def resolve_model(name: str, tmp: str, vocab: int) -> tuple[str, dict]:
    """(what LLM(model=...) takes, kwargs for transformers from_pretrained)."""
    if name == "qwen3-random":
        write_random_qwen3(tmp, vocab=vocab)
        return tmp, dict(pretrained_model_name_or_path=tmp)
    if name in GGUF_MODELS:
        try:
            from tokenspeed_jax.models import registry

            path, gguf = registry.gguf_location(name)  # issue 10's GGUF support
        except (ImportError, AttributeError, ValueError) as e:
            raise SystemExit(f"--model {name}: this build has no GGUF support for it yet ({e})") from e
        return name, dict(pretrained_model_name_or_path=path, gguf_file=gguf)
    if os.path.isdir(name):
        return name, dict(pretrained_model_name_or_path=name)
    raise SystemExit(f"--model {name!r}: expected qwen3-random, {sorted(GGUF_MODELS)} or a dir")


def make_ours(model: str, max_context_len: int, warm_kv: int):
    from tokenspeed_jax import LLM

    llm = LLM(
        model=model,
        max_batch_requests=64,
        max_scheduled_tokens=2048,
        max_context_len=max_context_len,
        num_pages=4096,
        page_size=16,
    )
    t0 = time.perf_counter()
    compiles = llm.warmup(max_kv_len=warm_kv)
    return llm, dict(warmup_s=time.perf_counter() - t0, warmup_compiles=compiles)


def run_ours(llm, prompts, new_tokens: int) -> dict:
    from tokenspeed_jax import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    steps0 = llm.stats().get("num_engine_steps", 0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    st = llm.stats()
    return dict(
        tokens=[o.token_ids for o in outs],
        wall_s=wall,
        compiles=st.get("num_compiles"),
        steps=st.get("num_engine_steps", 0) - steps0,
    )


def make_theirs(hf_kwargs: dict):
    import torch
    import transformers as tr

    return tr.AutoModelForCausalLM.from_pretrained(**hf_kwargs, dtype=torch.float32).eval()


def run_theirs(model, prompts, new_tokens: int) -> dict:
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding needed
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        wall = time.perf_counter() - t0
    return dict(tokens=out[:, ids.shape[1] :].tolist(), wall_s=wall)


def ctx_table(model: str, prompts, contexts=(2048, 8192, 32768), decode: int = 34) -> list[dict]:
    """Median time of the all-decode steps of the same requests at each max_context_len, with kv
    buckets (default) and without (`min_kv_bucket` = the whole context: one full-width level,
    what the runtime did before kv buckets)."""
    from tokenspeed_jax import LLM, SamplingParams

    rows = []
    for ctx in contexts:
        for mode, min_kv in (("kv buckets", None), ("full width", ctx)):
            extra = {} if min_kv is None else {"min_kv_bucket": min_kv}
            llm = LLM(
                model=model,
                max_batch_requests=64,
                max_scheduled_tokens=2048,
                max_context_len=ctx,
                num_pages=4096,
                page_size=16,
                **extra,
            )
            # compiles the keys this workload meets (lazily) and fills the prefix cache
            llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
            runner, times = llm.engine.runner, []
            inner = runner.dispatch  # what the engine calls (then `collect`)

            def timed(ops, _inner=inner, _times=times):
                t0 = time.perf_counter()
                handle = _inner(ops)
                if ops.num_seqs and ops.num_tokens == ops.num_seqs:  # every row decodes one token
                    handle.tokens.block_until_ready()  # the device work is finished
                    _times.append(time.perf_counter() - t0)
                return handle

            runner.dispatch = timed
            llm.generate(prompts, SamplingParams(max_tokens=decode, ignore_eos=True))
            runner.dispatch = inner
            rows.append(
                dict(
                    ctx=ctx,
                    mode=mode,
                    steps=len(times),
                    median_ms=statistics.median(times) * 1e3,
                    kv_levels=len(runner.shapes.kv_levels),
                    compiles=llm.stats().get("num_compiles"),
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        default="qwen3-random",
        help="qwen3-random | smollm2-135m (GGUF, issue 10) | a checkpoint dir",
    )
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--shared", type=int, default=384)
    ap.add_argument("--own", type=int, default=32)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-context-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx-table", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.new = 8, 8
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, hf_kwargs = resolve_model(args.model, tmp, args.vocab)
        vocab = args.vocab
        if args.model != "qwen3-random":
            import transformers as tr

            vocab = tr.AutoConfig.from_pretrained(**hf_kwargs).vocab_size
        # warm-up policy: every token bucket x the kv buckets up to this workload's longest row
        # (longer kv buckets would compile on first use; none occurs: see "compiles after")
        if args.repeats:  # --repeats 0: only the --ctx-table
            llm, warm = make_ours(model, args.max_context_len, args.shared + args.own + args.new)
            hf = None if args.skip_transformers else make_theirs(hf_kwargs)
            n_tok = args.requests * args.new
            ours_s, theirs_s, equal = [], [], []
            for rep in range(args.repeats):  # interleaved: both see the same machine load
                prompts = make_prompts(args.requests, args.shared, args.own, vocab, seed=rep)
                ours = run_ours(llm, prompts, args.new)  # new prompts: no hits from earlier reps
                ours_s.append(ours["wall_s"])
                if hf is not None:
                    theirs = run_theirs(hf, prompts, args.new)
                    theirs_s.append(theirs["wall_s"])
                    equal.append(sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"])))
            print(
                f"\n## e2e: {args.model}, {args.requests} x ({args.shared} shared + {args.own} own) "
                f"prompt, {args.new} greedy new tokens, float32, {args.threads} threads, "
                f"{args.repeats} interleaved repeats (best shown)\n"
            )
            print(
                "| engine | wall s (best) | all wall s | tokens/s | ratio vs transformers | "
                "greedy equal | notes |"
            )
            print("|---|---|---|---|---|---|---|")
            fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
            ratio = "n/a"
            if theirs_s:
                print(
                    f"| transformers generate | {min(theirs_s):.2f} | {fmt(theirs_s)} | "
                    f"{n_tok / min(theirs_s):.1f} | 1.00 | | padded static batch |"
                )
                ratio = f"{min(theirs_s) / min(ours_s):.2f}"
            eq = f"{min(equal)}/{args.requests}" if equal else "n/a"
            print(
                f"| tokenspeed-jax LLM.generate | {min(ours_s):.2f} | {fmt(ours_s)} | "
                f"{n_tok / min(ours_s):.1f} | {ratio} | {eq} | warmup {warm['warmup_s']:.1f} s "
                f"({warm['warmup_compiles']} compiles), {ours['steps']} steps, compiles after "
                f"{ours['compiles']} |"
            )
        if args.ctx_table:
            rows = ctx_table(model, make_prompts(args.requests, args.shared, args.own, vocab, 99))
            base = {r["mode"]: r["median_ms"] for r in rows if r["ctx"] == rows[0]["ctx"]}
            print("\n## decode step vs max_context_len (48 requests of ~450 tokens)\n")
            print("| max_context_len | mode | decode steps | median ms/step | vs 2k | kv levels | compiles |")
            print("|---|---|---|---|---|---|---|")
            for r in rows:
                print(
                    f"| {r['ctx']} | {r['mode']} | {r['steps']} | {r['median_ms']:.2f} | "
                    f"{r['median_ms'] / base[r['mode']]:.2f} | {r['kv_levels']} | "
                    f"{r['compiles']} |"
                )


if __name__ == "__main__":
    main()
