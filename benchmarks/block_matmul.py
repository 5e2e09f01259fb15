"""Block-quantized (GGUF Q4_1 / Q8_0, per-channel int8) matmul lowerings on XLA:CPU, side by
side (issue 26).

    python benchmarks/block_matmul.py [--rows 1,4,8,16,32,64,128] [--kind q4_1|q8_0|int8|f32|bf16]

30 chained SmolLM2-sized layers (x [rows, 576] @ W [576, 1536], then the next layer's x is the
first 576 columns), each W random Q4_1 / Q8_0 blocks in `models.block_quant`'s layout (int8:
one scale per output channel, `models.quant`'s weight-only "int8", a single block of all K
inputs; f32 / bf16: plain float weights), one jit per lowering: "native"
(`pallas_kernels.block_matmul_cpu`, one C++ custom call per layer, weights [K, N]), "tiled" (the
same call on tile-major weights, `pack_tiles`: what a one-device CPU model holds), "tiled q8 x"
(the tiled call with `x_q8`: x quantized per 32 values to int8, integer dot products where the CPU
has AVX512-VNNI, as llama.cpp's quantized products), "xla" (f32 /
bf16: XLA's own
dot as `models.layers.matmul` ran it before, activations in the weights' dtype), "tiled bf16 x"
(bf16: the tiled call on bf16 activations, as a bf16 model makes it: AMX tiles from 16 rows
on a CPU with AMX-BF16, and then "tiled bf16 x, no AMX" too, the same call with
TOKENSPEED_JAX_AMX=0), "split" (int8
activation rows, a batched int8 dot over the blocks), "float" (dequantize inside the step, one
float dot) and "f32" (a float32 copy of the weights, the unquantized reference). Median of
`--reps` after a warm call; "native rel. diff": max |tiled - f32| / max |f32| of one layer's
output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,8,16,32,64,128")
    p.add_argument("--kind", default="q4_1", choices=("q4_1", "q8_0", "int8", "f32", "bf16"))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()

    from benchmarks._machine import cpu_line
    from pallas_kernels.block_matmul_cpu import (
        amx_calls,
        available,
        block_matmul_cpu,
        block_matmul_reference,
        dense_matmul_cpu,
        pack_tiles,
    )
    from tokenspeed_jax.models import cpu_dot
    from tokenspeed_jax.models.block_quant import dequantize_blocks
    from tokenspeed_jax.models.quant import _split_int8_dot, split_rows

    k, n, layers = 576, 1536, args.layers
    rng = np.random.default_rng(0)
    lo, hi = (0, 16) if args.kind == "q4_1" else (-127, 128)
    codes = [jnp.asarray(rng.integers(lo, hi, (k, n)), jnp.int8) for _ in range(layers)]
    block = k if args.kind == "int8" else 32
    scales = [jnp.asarray(rng.random((k // block, n)) * 0.01, jnp.float32) for _ in range(layers)]
    mins = [
        jnp.asarray(rng.standard_normal((k // block, n)) * 0.01, jnp.float32) if args.kind == "q4_1" else None
        for _ in range(layers)
    ]
    dense = [block_matmul_reference(jnp.eye(k), c, s, m) for c, s, m in zip(codes, scales, mins, strict=True)]

    def split(x, c, s, m):
        if block == k:  # models.quant's "int8" lowering up to its SPLIT_MAX_ROWS
            return _split_int8_dot(x, c, (((1,), (0,)), ((), ()))) * s[0]
        g, rows = k // 32, x.shape[0]
        xq, s1, s2 = split_rows(x)
        acc = jax.lax.dot_general(
            xq.reshape(2 * rows, g, 32),
            c.reshape(g, 32, n),
            (((2,), (1,)), ((1,), (0,))),
            preferred_element_type=jnp.int32,
        ).astype(jnp.float32)
        y = jnp.sum((acc[:, :rows] * s1 + acc[:, rows:] * s2) * s[:, None, :], axis=0)
        return y if m is None else y + jnp.dot(jnp.sum(x.reshape(rows, g, 32), -1), m)

    if args.kind in ("f32", "bf16"):  # float weights: the native kernel against XLA's own dot
        wdt = jnp.float32 if args.kind == "f32" else jnp.bfloat16
        codes = [(d * 0.02).astype(wdt) for d in dense]
        dense = [c.astype(jnp.float32) for c in codes]
        lowerings = {
            "native": lambda x, c, s, m, w, t: dense_matmul_cpu(x, c),
            "tiled": lambda x, c, s, m, w, t: dense_matmul_cpu(x, t),
            # XLA's dot as `models.layers.matmul` runs it: activations in the weights' dtype
            "xla": lambda x, c, s, m, w, t: cpu_dot.dot(x.astype(c.dtype), c, 0, jnp.float32),
        }
        if args.kind == "bf16":
            # as a bf16 model calls it: bf16 activations (AMX tiles from 16 rows where the CPU
            # has them, else AVX512-BF16's dot product)
            lowerings["tiled bf16 x"] = lambda x, c, s, m, w, t: dense_matmul_cpu(x.astype(jnp.bfloat16), t)
            if "amx_bf16" in cpu_line():  # the same call with the tiles off (read per call)
                lowerings["tiled bf16 x, no AMX"] = lambda x, c, s, m, w, t: dense_matmul_cpu(
                    x.astype(jnp.bfloat16), t
                )
            lowerings["f32"] = lambda x, c, s, m, w, t: jnp.dot(x, w)
    else:
        lowerings = {
            "native": lambda x, c, s, m, w, t: block_matmul_cpu(x, c, s, m),
            "tiled": lambda x, c, s, m, w, t: block_matmul_cpu(x, t, s, m),
            # x quantized per 32 values (llama.cpp's Q8 activations): AVX512-VNNI integer dots
            "tiled q8 x": lambda x, c, s, m, w, t: block_matmul_cpu(x, t, s, m, x_q8=True),
            "split": lambda x, c, s, m, w, t: split(x, c, s, m),
            "float": lambda x, c, s, m, w, t: (
                jnp.dot(x, c.astype(x.dtype)) * s[0] if block == k else jnp.dot(x, dequantize_blocks(c, s, m))
            ),
            "f32": lambda x, c, s, m, w, t: jnp.dot(x, w),
        }

    tiles = [pack_tiles(c) for c in codes]  # tile-major copies (`pack_tiles`)

    def chain(fn):
        def run(x, cs, ss, ms, ws, ts):
            for c, s, m, w, t in zip(cs, ss, ms, ws, ts, strict=True):
                x = jnp.tanh(fn(x, c, s, m, w, t)[:, :k])
            return x

        return jax.jit(run)

    print(
        f"{cpu_line()}; jax {jax.__version__}, native kernel built: {available()}; "
        f"{layers} layers of [rows, {k}] @ {args.kind} [{k}, {n}]\n"
    )
    print("| rows | " + " | ".join(f"{name} ms" for name in lowerings) + " | best | native rel. diff |")
    print("|---|" + "---|" * (len(lowerings) + 2))
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
        ms = {}
        for name, fn in lowerings.items():
            os.environ["TOKENSPEED_JAX_AMX"] = "0" if name.endswith("no AMX") else "1"
            f = chain(fn)
            jax.block_until_ready(f(x, codes, scales, mins, dense, tiles))  # compile
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                jax.block_until_ready(f(x, codes, scales, mins, dense, tiles))
                times.append(time.perf_counter() - t)
            ms[name] = 1e3 * statistics.median(times)
        best = min(ms, key=ms.__getitem__)
        # one layer, not the chain: the tanh chain saturates to +-1 and hides differences
        want = np.asarray(x @ dense[0])
        got = np.asarray(lowerings["tiled"](x, codes[0], scales[0], mins[0], dense[0], tiles[0]))
        diff = np.abs(got - want).max() / np.abs(want).max()
        print(
            f"| {rows} | "
            + " | ".join(f"{ms[name]:.1f}" for name in lowerings)
            + f" | {best} | {diff:.1e} |",
            flush=True,
        )
    if args.kind == "bf16":
        print(f"\nproducts on AMX tiles in this run: {amx_calls()}")


if __name__ == "__main__":
    main()
