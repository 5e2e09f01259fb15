"""Step 6: the gated delta chunk kernel (issue 47) on the GPU beside the jnp chunked form.

Qwen3.5-shaped prefill of one Gated DeltaNet layer: H = 32 value heads, Dk = Dv = 128, 64-token
chunks, bf16 q / k / v, S tokens from a warm state. For each implementation ("jnp": XLA's fusion
of `gated_delta._chunk`, "pallas": `gated_delta_pallas`): ms per call (median of 5 after a
compile), and the largest difference of its outputs / final state from the jnp ones. The kernel
has only been compiled for sm_90a (test_compile_sm90.py), never run: this step is its first
timing, and decides `GatedDeltaConfig.chunk_impl`'s default. Rehearsal: S = 64, H = 2, Dk = Dv =
16 in interpret mode on CPU.
"""

from __future__ import annotations

import time

import common  # noqa: F401  (sys.path)
from common import REHEARSE, result

S, H, DK, DV, CHUNK = (64, 2, 16, 16, 16) if REHEARSE else (8192, 32, 128, 128, 64)


def main() -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gated_delta import GatedDeltaConfig, gated_delta_chunked, l2norm

    keys = jax.random.split(jax.random.key(0), 6)
    q = (l2norm(jax.random.normal(keys[0], (S, H, DK))) * DK**-0.5).astype(jnp.bfloat16)
    k = l2norm(jax.random.normal(keys[1], (S, H, DK))).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (S, H, DV), jnp.bfloat16)
    g = -jax.random.uniform(keys[3], (S, H), jnp.float32, 0.0, 8.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (S, H)))
    state = jax.random.normal(keys[5], (H, DK, DV), jnp.float32)
    outs = {}
    for impl in ("jnp", "pallas"):
        config = GatedDeltaConfig(CHUNK, impl)
        fn = jax.jit(lambda *xs, c=config: gated_delta_chunked(*xs, c))
        try:
            t = time.perf_counter()
            jax.block_until_ready(fn(q, k, v, g, beta, state))
            compile_s = time.perf_counter() - t
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                outs[impl] = jax.block_until_ready(fn(q, k, v, g, beta, state))
                ts.append(time.perf_counter() - t)
        except Exception as e:  # a kernel that fails on the GPU is a result, not a crash
            result("6_gated_delta", impl=impl, failed=f"{type(e).__name__}: {str(e)[:400]}")
            continue
        diff = {}
        if impl != "jnp" and "jnp" in outs:
            diff = {
                "max_diff_out": float(jnp.max(jnp.abs(outs[impl][0] - outs["jnp"][0]))),
                "max_diff_state": float(jnp.max(jnp.abs(outs[impl][1] - outs["jnp"][1]))),
            }
        ms = 1e3 * sorted(ts)[2]
        shape = dict(tokens=S, heads=H, dk=DK, dv=DV, chunk=CHUNK)
        result("6_gated_delta", impl=impl, **shape, compile_s=round(compile_s, 2), ms=round(ms, 3), **diff)


if __name__ == "__main__":
    main()
