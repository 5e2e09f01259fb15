"""Hybrid recurrent models at realistic layer shapes (issue 47): decode at long context, prefill
scaling, prefix hits of the recurrent state, and transformers in the same run.

    python benchmarks/hybrid.py            # 1k / 32k decode, 1k / 8k prefill, multi-turn, HF
    python benchmarks/hybrid.py --quick    # the same at 256 / 2k tokens (a few minutes)

Checkpoints are written by transformers (`Qwen3_5ForCausalLM`, random weights, seed 0) with the
per-layer shapes of Qwen3.5-0.8B: hidden 1024; Gated DeltaNet with 16 key and 16 value heads of
128 and a 4-tap conv; gated attention with 8 query / 2 KV heads of 256 and RoPE on a quarter of
each head; MLP 3584. Four layers, vocab 32000 (the rest of a real model scales every row alike).
Three variants of those shapes: "hybrid" (3 DeltaNet : 1 attention, Qwen3.5's ratio),
"recurrent" (4 DeltaNet layers: the recurrent layers alone) and "attention" (4 attention layers).

1. decode ms per output token of one request (TPOT, shapes warm) after a prompt of 1k and 32k
   tokens: target <= 1.2x for the recurrent layers;
2. prefill seconds of one 1k and one 8k prompt (TTFT, shapes compiled by an untimed run first):
   target 8k / 1k <= 8.8x;
3. a multi-turn workload (sessions sharing a system prompt, each turn resending its history):
   prefix hit rate of the hybrid within 5 points of the attention model's;
4. transformers `generate` on the hybrid checkpoint: same greedy tokens, time per request;
5. one memory budget (1 GiB; --quick 0.75), more sessions: one shared pool, where every page id
   pays for the K/V of the attention layers and a state snapshot of each DeltaNet layer, against
   the engine's default, a state pool of its own (`state_pool_share` 0.5), and that pool with a
   snapshot every 64 tokens (`state_page_size`): pages of each kind, prefix hit rate,
   retractions; the attention model on the same budget beside.
Pages: 64 tokens in 1-2 (so 32k tokens of snapshots fit this machine's memory in one shared pool:
the bytes per page id are printed below), 16 in 3 and 5 (the prefix-cache granularity users get
by default).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from benchmarks._machine import cpu_line  # noqa: E402

VOCAB = 32000
LAYERS = {
    "hybrid": ["linear_attention"] * 3 + ["full_attention"],
    "recurrent": ["linear_attention"] * 4,
    "attention": ["full_attention"] * 4,
}


def write_checkpoint(path: str, layer_types: list[str]) -> None:
    import torch
    import transformers as tr

    cfg = tr.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=3584, num_hidden_layers=len(layer_types),
        layer_types=layer_types, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    tr.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def engine(path: str, page: int, context: int, pages: int | None, **kw):
    from tokenspeed_jax import LLM

    return LLM(path, page_size=page, num_pages=pages, max_context_len=context + 128, max_batch_requests=8,
               max_scheduled_tokens=2048, lazy_compile="sync", **kw)  # fmt: skip


def prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, VOCAB, n).tolist()


def decode_ms(path: str, context: int) -> float:
    """Milliseconds per output token of one request after a `context`-token prompt. The same
    prompt runs twice: the first compiles every shape; the second resumes from the prefix cache
    (its state snapshots) and decodes on warm shapes, so its TPOT is the decode step alone."""
    from tokenspeed_jax import SamplingParams

    llm = engine(path, 64, context, 2 * (context // 64) + 16)
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    ids = prompt(np.random.default_rng(context), context)
    llm.generate([ids], sp)
    out = llm.generate([ids], sp)[0]
    assert out.metrics is not None and out.metrics.num_cached_tokens >= context - 64, "no prefix hit"
    del llm
    gc.collect()
    return 1e3 * float(out.tpot or 0.0)


def prefill_s(path: str, n: int) -> float:
    from tokenspeed_jax import SamplingParams

    llm = engine(path, 64, n, 3 * (n // 64) + 16, enable_prefix_cache=False)
    rng = np.random.default_rng(n)
    one = SamplingParams(max_tokens=1)
    llm.generate([prompt(rng, n)], one)  # compiles this length's step shapes
    t = time.perf_counter()
    llm.generate([prompt(rng, n)], one)
    dt = time.perf_counter() - t
    del llm
    gc.collect()
    return dt


def multi_turn(path: str, system: int, sessions: int, turns: int, pages: int | None = 1024, **pool) -> dict:
    """Stats of the multi-turn workload (`prefix_hit_rate`, ...) plus the pools' "kv_pages" /
    "state_pages"; pool: the pool options when `pages` is None."""
    from tokenspeed_jax import SamplingParams

    rng = np.random.default_rng(7)
    sys_prompt = prompt(rng, system)
    history = [list(sys_prompt) for _ in range(sessions)]
    llm = engine(path, 16, system + turns * 200, pages, **pool)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    for _ in range(turns):
        for h in history:
            h += prompt(rng, int(rng.integers(40, 90)))  # the user's message
        outs = llm.generate([list(h) for h in history], sp)
        for h, o in zip(history, outs, strict=True):
            h += o.token_ids
    st = dict(llm.stats())
    layout = llm.engine.runner.layout
    st.update(kv_pages=layout.num_pages - 1, state_pages=(layout.state_pages or 1) - 1)
    del llm
    gc.collect()
    return st


def versus_transformers(path: str, n: int, new: int) -> tuple[bool, float, float]:
    """(same greedy tokens, our seconds, transformers' seconds) for one n-token prompt."""
    import torch
    import transformers as tr

    from tokenspeed_jax import SamplingParams

    ids = prompt(np.random.default_rng(3), n)
    llm = engine(path, 16, n + new, 3 * (n // 16) + 16)
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    llm.generate([prompt(np.random.default_rng(4), n)], sp)  # compile
    t = time.perf_counter()
    ours = llm.generate([ids], sp)[0].token_ids
    ours_s = time.perf_counter() - t
    del llm
    ref = tr.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref.generate(torch.tensor([ids[:32]]), max_new_tokens=2, do_sample=False)  # warm
        t = time.perf_counter()
        out = ref.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None)
        hf_s = time.perf_counter() - t
    return out[0, n:].tolist() == ours, ours_s, hf_s


def page_bytes(path: str, page: int) -> tuple[int, int]:
    """(state snapshot bytes, attention K/V bytes) one page id costs in the hybrid."""
    from tokenspeed_jax.hf import load_config
    from tokenspeed_jax.runtime.state import page_bytes_by_pool

    cfg = load_config(path)
    n = len(cfg.layer_types)  # one group per layer: each layer's pools at one page id
    attn, state = page_bytes_by_pool(cfg, tuple(range(n)), (page,) * n)
    return state, attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short contexts (256 / 2048) and workload")
    args = ap.parse_args()
    short, long_, pre_long = (256, 2048, 2048) if args.quick else (1024, 32768, 8192)
    pre_short = short
    print(f"machine: {cpu_line()}")
    root = tempfile.mkdtemp(prefix="hybrid_bench_")
    paths = {}
    for name, types in LAYERS.items():
        paths[name] = os.path.join(root, name)
        write_checkpoint(paths[name], types)
    state, attn = page_bytes(paths["hybrid"], 64)
    print(f"hybrid bytes per page id (page 64): state snapshots {state / 2**20:.2f} MiB, attention K/V "
          f"{attn / 2**20:.2f} MiB")  # fmt: skip

    print(f"\n| decode ms/token (TPOT, batch 1) | {short} ctx | {long_} ctx | ratio |\n|---|---|---|---|")
    for name in ("recurrent", "hybrid"):
        a, b = decode_ms(paths[name], short), decode_ms(paths[name], long_)
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |", flush=True)

    print(
        f"\n| prefill s (one prompt) | {pre_short} | {pre_long} | ratio ({pre_long // pre_short}x tokens) |"
    )
    print("|---|---|---|---|")
    for name in ("recurrent", "hybrid"):
        a, b = prefill_s(paths[name], pre_short), prefill_s(paths[name], pre_long)
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |", flush=True)

    system, sessions, turns = (200, 4, 3) if args.quick else (700, 6, 4)
    print(f"\nmulti-turn: {sessions} sessions x {turns} turns, a {system}-token system prompt, page 16")
    print("| model | prefix hit rate | hit tokens / prompt tokens |\n|---|---|---|")
    rates = {}
    for name in ("attention", "hybrid"):
        st = multi_turn(paths[name], system, sessions, turns)
        rates[name] = st["prefix_hit_rate"]
        print(
            f"| {name} | {100 * rates[name]:.1f}% | {st['prefix_hit_tokens']} / {st['prefix_query_tokens']} |"
        )
    print(f"hybrid - attention: {100 * (rates['hybrid'] - rates['attention']):+.1f} points", flush=True)

    gib = 0.75 if args.quick else 1.0
    sessions, turns = (8, 2) if args.quick else (16, 3)
    print(f"\none budget: {gib} GiB of cache, {sessions} sessions x {turns} turns, system prompt {system}")
    print("| model | pools | K/V pages | state snapshots | prefix hit rate | retractions |")
    print("|---|---|---|---|---|---|")
    runs = [
        ("attention", "one pool", 0.5, None),
        ("hybrid", "one shared pool", 0.0, None),
        ("hybrid", "state pool", 0.5, None),
        ("hybrid", "state pool, a snapshot every 64 tokens", 0.5, 64),
    ]
    for name, label, share, every in runs:
        st = multi_turn(paths[name], system, sessions, turns, None, kv_cache_memory_bytes=int(gib * 2**30),
                        state_pool_share=share, state_page_size=every)  # fmt: skip
        kv, snaps = st["kv_pages"], st["state_pages"] or ("(the K/V page ids)" if name == "hybrid" else "-")
        print(f"| {name} | {label} | {kv} | {snaps} | {100 * st['prefix_hit_rate']:.1f}% | "
              f"{st['num_retractions']} |", flush=True)  # fmt: skip

    n, new = (256, 16) if args.quick else (1024, 32)
    same, ours, hf = versus_transformers(paths["hybrid"], n, new)
    print(f"\ntransformers generate, hybrid, {n}-token prompt + {new} tokens: same greedy tokens {same}; "
          f"ours {ours:.2f} s, transformers {hf:.2f} s ({hf / ours:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
