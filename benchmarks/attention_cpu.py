"""CPU paged attention, one layer: the jnp reference vs the native backend (C++ custom calls),
side by side in one process; "tokens only" = native decode tokens, prefill blocks in jnp.

    python benchmarks/attention_cpu.py [--reps 3] [--pool-pages 2048]

SmolLM2 shapes (9 q / 3 kv heads of 64, page 16), random page ids in a pool of `--pool-pages`
pages (so K/V come from memory, not cache, as in a 30-layer model), kv-bucketed page tables as
the runtime passes them. Each case: both implementations jitted, 10 calls per timing, best of
`--reps` alternating timings; max |difference| of their outputs.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import paged_attention_reference  # noqa: E402
from pallas_kernels.paged_attention_cpu import available, paged_attention_cpu  # noqa: E402

HQ, HKV, D, PAGE = 9, 3, 64, 16
# (label, decodes, context around which their lengths vary, prefill chunk tokens, dtype)
CASES = [
    ("16 decodes at ~450", 16, 450, 0, "float32"),
    ("32 decodes at ~400", 32, 400, 0, "float32"),
    ("32 decodes at ~1500", 32, 1500, 0, "float32"),
    ("32 decodes at ~400, bf16 pools (bits)", 32, 400, 0, "bfloat16"),
    ("32 decodes at ~400, int8 pools", 32, 400, 0, "int8"),
    ("15 decodes + a 241-token chunk", 15, 450, 241, "float32"),
    ("one 512-token chunk", 0, 0, 512, "float32"),
]


def make_case(
    rng: np.random.Generator, n_dec: int, ctx: int, chunk: int, dtype: str, pool_pages: int
) -> tuple[tuple, dict]:
    s = n_dec + (1 if chunk else 0)
    k = rng.standard_normal((pool_pages, PAGE, HKV, D)).astype(np.float32)
    v = rng.standard_normal((pool_pages, PAGE, HKV, D)).astype(np.float32)
    kw: dict = {}
    if dtype == "bfloat16":
        k, v = (jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.bfloat16), jnp.uint16) for a in (k, v))
    elif dtype == "int8":
        from pallas_kernels import kv_quant, pool_bits

        (k, ks), (v, vs) = (kv_quant.quantize(jnp.asarray(a), jnp.int8) for a in (k, v))
        kw = dict(
            k_scales=jax.lax.bitcast_convert_type(ks, pool_bits.BITS),
            v_scales=jax.lax.bitcast_convert_type(vs, pool_bits.BITS),
        )
    q_lens = [1] * n_dec + ([chunk] if chunk else [])
    kv_lens = [ctx + int(rng.integers(-50, 50)) for _ in range(n_dec)] + ([chunk] if chunk else [])
    t = sum(q_lens)
    tokens = 1 << (t - 1).bit_length()  # the token bucket
    q_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    q = jnp.asarray(rng.standard_normal((tokens, HQ, D)), q_dtype)
    cu = np.zeros(s + 1, np.int32)
    cu[1:] = np.cumsum(q_lens)
    cols = 1 << (-(-max(kv_lens) // PAGE) - 1).bit_length()  # the kv bucket
    table = rng.integers(1, pool_pages, (s, cols)).astype(np.int32)
    args = (
        q,
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(table),
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(cu),
        jnp.asarray([s], jnp.int32),
    )
    return args, kw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pool-pages", type=int, default=2048)
    args = p.parse_args()
    if not available():
        print("the native kernel cannot be built here (pallas_kernels.native.unavailable)")
        return
    rng = np.random.default_rng(0)
    fns = {
        "reference": jax.jit(paged_attention_reference),
        "tokens only": jax.jit(functools.partial(paged_attention_cpu, native_blocks=False)),
        "native": jax.jit(paged_attention_cpu),
    }
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, pool {args.pool_pages} pages\n")
    print("| one layer | reference ms | tokens only ms | native ms | reference / native | max abs diff |")
    print("|---|---|---|---|---|---|")
    for label, n_dec, ctx, chunk, dtype in CASES:
        call_args, kw = make_case(rng, n_dec, ctx, chunk, dtype, args.pool_pages)
        outs = {name: np.asarray(f(*call_args, **kw).astype(jnp.float32)) for name, f in fns.items()}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.reps):
            for name, f in fns.items():
                t = time.perf_counter()
                for _ in range(10):
                    f(*call_args, **kw).block_until_ready()
                best[name] = min(best[name], (time.perf_counter() - t) / 10 * 1e3)
        diff = float(np.max(np.abs(outs["reference"] - outs["native"])))
        print(
            f"| {label} | {best['reference']:.2f} | {best['tokens only']:.2f} | "
            f"{best['native']:.2f} | "
            f"{best['reference'] / best['native']:.2f}x | {diff:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
