"""Steps 2 and 3: our engine on the step-1 checkpoint with the platform defaults.

    python ours.py cold   # step 2: load + compile (empty cache), then the measurements below
    python ours.py warm   # step 3: a second process, warm start from the executable cache

cold: parameter dtype and bytes, pool pages, the largest step's temporaries, host peak RSS,
compile seconds per shape; decode ms/step and tok/s at ROWS rows, as (T(long) - T(short)) /
(long - short tokens) over fresh prompts (prefill cancels), beside the weight + KV read bytes
per step (summary.py divides by the measured bandwidth), with the overlapped loop and the
synchronous one; seeded sampling twice with other batch mates (same tokens); greedy tokens,
logprobs and prompt logprobs of the check prompts, saved for steps 3 and 5.
warm: start-up seconds and shapes loaded from the store; the same greedy tokens as cold.
"""

from __future__ import annotations

import json
import sys
import time

import common  # noqa: F401  (sys.path)
from common import (
    CACHE,
    CHECK_PROMPT_LEN,
    CHECK_PROMPTS,
    CHECK_TOKENS,
    CKPT,
    DECODE_LONG,
    DECODE_SHORT,
    ENGINE,
    MODEL,
    OURS_JSON,
    PROMPT_LEN,
    ROWS,
    host_peak_rss_gb,
    kv_bytes_per_token,
    result,
)  # fmt: skip

SHOWN_ARGS = (
    "dtype",
    "max_batch_requests",
    "max_scheduled_tokens",
    "gpu_memory_utilization",
    "attention_backend",
)


def build(step: str):
    import jax

    from tokenspeed_jax import LLM

    t0 = time.perf_counter()
    llm = LLM(CKPT, compile_cache_dir=CACHE, **ENGINE)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    llm.warmup()
    warm_s = time.perf_counter() - t1
    st = llm.startup_stats()
    runner = llm.engine.runner
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.param_leaves))
    mem = jax.devices()[0].memory_stats() or {}
    paths = jax.tree_util.tree_leaves_with_path(runner.params)
    result(
        step,
        device=str(jax.devices()[0]),
        jax=jax.__version__,
        args={k: v for k, v in llm.args.llm_options().items() if k in SHOWN_ARGS},
        param_dtype=str(llm.model_config.dtype),
        param_bytes=param_bytes,
        fused_qkv=any("qkv_proj" in jax.tree_util.keystr(p) for p, _ in paths),
        num_pages=runner.layout.num_pages,
        pool_bytes=sum(x.nbytes for x in jax.tree.leaves(runner.state.caches)),
        step_temp_bytes=llm.step_temp_bytes,
        device_bytes_in_use=mem.get("bytes_in_use"),
        device_bytes_limit=mem.get("bytes_limit"),
        host_peak_rss_gb=host_peak_rss_gb(),
        load_s=load_s,
        warmup_s=warm_s,
        start_s=load_s + warm_s,
        shapes_compiled=st.get("shapes_compiled", 0),
        shapes_loaded=st.get("shapes_loaded", 0),
        per_shape_s={
            str(s["bucket"]): round(s["compile_s"] + s["trace_s"] + s["load_s"], 2) for s in st["shapes"]
        },
    )
    return llm


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(3, MODEL["vocab_size"], (n, length)).tolist()


def decode_rates(llm, async_scheduling: bool) -> None:
    import jax

    from tokenspeed_jax import SamplingParams

    for e in llm.engines:  # the loop is chosen per step: switch it between generate calls
        e.async_scheduling = async_scheduling
    kv_token = kv_bytes_per_token(MODEL)
    weights = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.param_leaves))
    for i, rows in enumerate(ROWS):
        times = {}
        for j, new in enumerate((DECODE_SHORT, DECODE_LONG)):
            ps = prompts(rows, PROMPT_LEN, seed=1000 * (i + 1) + 10 * j + int(async_scheduling))
            sp = SamplingParams(max_tokens=new, ignore_eos=True)
            for e in llm.engines:
                e.clock.reset()  # the loop timing of this run alone
            t = time.perf_counter()
            outs = llm.generate(ps, sp)
            times[new] = time.perf_counter() - t
            assert all(len(o.token_ids) == new for o in outs)
        steps = DECODE_LONG - DECODE_SHORT
        ms = 1e3 * (times[DECODE_LONG] - times[DECODE_SHORT]) / steps
        ctx = PROMPT_LEN + (DECODE_SHORT + DECODE_LONG) / 2  # mean context of the extra steps
        result(
            "2_decode",
            rows=rows,
            overlapped=async_scheduling,
            ms_per_step=ms,
            tok_s=rows / ms * 1e3,
            read_bytes_per_step=weights + rows * ctx * kv_token,
            wall_s_long=times[DECODE_LONG],
            stats={k: v for k, v in llm.engine.stats().items() if k.endswith("_ms_per_step")},
        )


def checks(llm) -> dict:
    from tokenspeed_jax import SamplingParams

    ps = prompts(CHECK_PROMPTS, CHECK_PROMPT_LEN, seed=7)
    greedy = llm.generate(
        ps, SamplingParams(max_tokens=CHECK_TOKENS, logprobs=True, prompt_logprobs=True, ignore_eos=True)
    )
    sp = SamplingParams(
        max_tokens=CHECK_TOKENS, temperature=0.8, top_p=0.95, top_k=50, seed=11, ignore_eos=True
    )
    a = llm.generate(ps[:2], sp)
    b = llm.generate(ps[:2] + prompts(3, CHECK_PROMPT_LEN, seed=8), sp)[:2]  # other batch mates
    return dict(
        prompts=ps,
        tokens=[o.token_ids for o in greedy],
        logprobs=[o.logprobs for o in greedy],
        prompt_logprobs=[o.prompt_logprobs for o in greedy],
        sampled_same=[x.token_ids == y.token_ids for x, y in zip(a, b)],
        sampled_differs_from_greedy=[x.token_ids != g.token_ids for x, g in zip(a, greedy)],
    )


def main(mode: str) -> None:
    import math

    if mode == "cold":
        import shutil

        shutil.rmtree(CACHE, ignore_errors=True)  # a cold start compiles everything
    llm = build("2_cold_start" if mode == "cold" else "3_warm_start")
    got = checks(llm)
    if mode == "cold":
        with open(OURS_JSON, "w") as f:
            json.dump(got, f)
        finite = all(math.isfinite(x) for row in got["prompt_logprobs"] for x in row[1:])
        result(
            "2_checks",
            sampled_same=got["sampled_same"],
            sampled_differs=got["sampled_differs_from_greedy"],
            prompt_logprobs_finite=finite,
            tokens_head=[t[:8] for t in got["tokens"]],
        )
        decode_rates(llm, async_scheduling=True)
        decode_rates(llm, async_scheduling=False)
    else:
        with open(OURS_JSON) as f:
            cold = json.load(f)
        same = [a == b for a, b in zip(got["tokens"], cold["tokens"])]
        result("3_warm_same_tokens", same=same, all_same=all(same))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cold")
