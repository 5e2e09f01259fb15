"""Weight updates, sleep and wake (issue 48): what an RL loop pays per policy handoff.

    python benchmarks/weight_update.py                      # SmolLM2-135M (HF dir) + a 1B-shaped random Llama
    python benchmarks/weight_update.py --models smollm2     # one of them; --quick: the tiny model only

Per model (a Hugging Face checkpoint directory; SmolLM2 is written by benchmarks/smollm2_hf.py,
the 1B-shaped one (Llama-3.2-1B's shapes, vocab 32000, bf16) is drawn at random into a temp dir):
- cold load: `LLM(dir)` with `num_pages` given (nothing compiles): read + prepare + place, until
  the weights are on the device (`block_until_ready`);
- from disk: `llm.update_weights(dir)` (the same files again);
- in-process handoff: `llm.update_weights(state)` with `state` the raw params as a JAX trainer
  holds them (an `nnx.State` of jax arrays in our dtype, on our device): seconds and s / GiB of
  weights; and the same as (HF name, jax array) pairs (kernels transposed on the device);
- sleep(level=1): bytes freed (over `jax.live_arrays()`) vs the KV pool's bytes;
- wake to first token: `wake_up()` then a 1-token generate, with the step executables warm
  (tiny model).
Targets: handoff <= 0.2 s / GiB on CPU; from disk <= cold load; sleep frees >= 90 % of the pool;
wake to first token <= 2 s on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

GiB = 1 << 30
ONE_B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", hidden_act="silu",
)  # fmt: skip


def write_random_llama(path: str, cfg: dict) -> str:
    """A random bf16 Llama checkpoint of `cfg`'s shapes (kept when it exists)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    t = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "model.norm.weight": w(h) + 1}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t |= {p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
              p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
              p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
              p + "mlp.down_proj.weight": w(h, i), p + "input_layernorm.weight": w(h) + 1,
              p + "post_attention_layernorm.weight": w(h) + 1}  # fmt: skip
    save_file(t, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def bench_model(name: str, path: str, dtype: str, repeats: int, layout: str = "auto") -> dict:
    """layout "checkpoint" (`weight_layout`): the engine keeps the trainer's layout (no tile-major
    re-layout for the native CPU kernel, no q/k/v + gate/up fusion), so the handoff shares the
    arrays and no transform runs; its decode is what that costs."""
    import jax
    from flax import nnx

    from tokenspeed_jax import LLM
    from tokenspeed_jax.hf import load_checkpoint
    from tokenspeed_jax.runtime.weight_inputs import hf_tensors

    opts = dict(dtype=dtype, num_pages=512, page_size=16, max_batch_requests=8, max_context_len=1024,
                weight_layout=layout)  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(path, **opts)
    jax.block_until_ready(llm.engine.runner.param_leaves)  # dispatch is asynchronous
    cold = time.perf_counter() - t0
    # the trainer's params: raw, in our dtype, on our device
    _, net, _ = load_checkpoint(path, dtype=llm.dtype)
    state = nnx.state(net, nnx.Param)
    raw_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    hf_pairs = [(k, jax.numpy.asarray(v)) for k, v in hf_tensors(state).items()]

    t = time.perf_counter()
    llm.update_weights(state)
    first = time.perf_counter() - t

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    handoff = best(lambda: llm.update_weights(state))
    handoff_hf = best(lambda: llm.update_weights(hf_pairs))
    hf_pairs.clear()
    disk = best(lambda: llm.update_weights(path))
    decode = decode_tok_s(llm)
    slept = llm.sleep(level=1)
    t = time.perf_counter()
    llm.wake_up()
    wake = time.perf_counter() - t
    return {
        "model": name,
        "weights GiB": raw_bytes / GiB,
        "cold load s": cold,
        "from disk s": disk,
        "1st handoff s": first,
        "handoff s": handoff,
        "handoff s/GiB": handoff / (raw_bytes / GiB),
        "hf pairs s": handoff_hf,
        "decode tok/s": decode,
        "pool MiB": slept["kv_bytes"] / (1 << 20),
        "sleep freed %": 100 * slept["freed_bytes"] / slept["kv_bytes"],
        "wake s": wake,
    }


def decode_tok_s(llm) -> float:
    """8 requests x 32 greedy tokens after 16-token prompts (after a run that compiles): output
    tokens per second, what the layout costs a rollout."""
    from tokenspeed_jax import SamplingParams

    prompts = [[1 + (7 * i + j) % 500 for j in range(16)] for i in range(8)]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    llm.generate(prompts, sp)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def wake_to_first_token(repeats: int) -> dict:
    """The tiny model, executables warm: sleep, then wake_up + a 1-token generate."""
    from tokenspeed_jax import LLM, SamplingParams

    llm = LLM("tiny-random", num_pages=256, max_batch_requests=8, max_context_len=512)
    llm.warmup()
    sp = SamplingParams(max_tokens=1)
    llm.generate(["hello"], sp)
    times, freed = [], []
    for level in [1] * repeats + [2] * repeats:
        info = llm.sleep(level=level)
        freed.append(info["freed_bytes"] / max(info["kv_bytes"], 1))
        t = time.perf_counter()
        llm.wake_up()
        llm.generate(["hello"], sp)
        times.append((level, time.perf_counter() - t))
    return {
        "level 1 s": min(t for lv, t in times if lv == 1),
        "level 2 s": min(t for lv, t in times if lv == 2),
        "compiles": llm.stats()["num_compiles"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,1b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the tiny model's wake only")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "tokenspeed-weight-update"))
    args = ap.parse_args()
    rows = []
    if not args.quick:
        for m in args.models.split(","):
            if m == "smollm2":
                from benchmarks.smollm2_hf import build, default_dir

                path = build(default_dir())
                for lay in ("auto", "checkpoint"):
                    rows.append(bench_model(f"SmolLM2-135M f32, {lay}", path, "float32", args.repeats, lay))
            elif m == "1b":
                path = write_random_llama(os.path.join(args.dir, "llama-1b-random"), ONE_B)
                for lay in ("auto", "checkpoint"):
                    rows.append(bench_model(f"1B-shaped bf16, {lay}", path, "bfloat16", args.repeats, lay))
            else:
                raise SystemExit(f"unknown model {m!r}: smollm2 | 1b")
    if rows:
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for r in rows:
            cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()]
            print("| " + " | ".join(cells) + " |")
    w = wake_to_first_token(args.repeats)
    print(
        f"\ntiny-random, executables warm: wake_up + first token {w['level 1 s']:.3f} s after "
        f"sleep(1), {w['level 2 s']:.3f} s after sleep(2) (weights regenerated); "
        f"step compiles in all: {w['compiles']}"
    )


if __name__ == "__main__":
    main()
