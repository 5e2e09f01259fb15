"""Step 6: issue 47's recurrent chunk kernels on the GPU beside their jnp chunked forms.

Prefill of one recurrent layer from a warm state, S tokens in 64-token chunks:
- "gated_delta": Qwen3.5-shaped Gated DeltaNet, H = 32 value heads, Dk = Dv = 128, bf16 q / k / v
  (`gated_delta_pallas` against XLA's fusion of `gated_delta_chunk.chunk_jnp`);
- "ssd": Bamba-9B-shaped Mamba2 SSD, H = 64 heads of P = 64, N = 128 in 8 groups, bf16 x / B / C
  (`mamba2_ssd_pallas` against `mamba2_ssd_chunk.chunk_jnp`).
For each kernel and implementation: ms per call (median of 5 after a compile) and the largest
difference of its outputs / final state from the jnp ones. Neither kernel has run on a GPU yet
(both compile for sm_90a: test_compile_sm90.py): this step is their first timing, and decides
the `chunk_impl` defaults. Rehearsal: S = 64 at tiny widths in interpret mode on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import common  # noqa: F401  (sys.path)
from common import REHEARSE, result

S, CHUNK = (64, 16) if REHEARSE else (8192, 64)


def gated_delta_case() -> tuple[dict, Callable, tuple]:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gated_delta import GatedDeltaConfig, gated_delta_chunked, l2norm

    h, dk, dv = (2, 16, 16) if REHEARSE else (32, 128, 128)
    keys = jax.random.split(jax.random.key(0), 6)
    q = (l2norm(jax.random.normal(keys[0], (S, h, dk))) * dk**-0.5).astype(jnp.bfloat16)
    k = l2norm(jax.random.normal(keys[1], (S, h, dk))).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (S, h, dv), jnp.bfloat16)
    g = -jax.random.uniform(keys[3], (S, h), jnp.float32, 0.0, 8.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (S, h)))
    state = jax.random.normal(keys[5], (h, dk, dv), jnp.float32)

    def make(impl: str) -> Callable:
        config = GatedDeltaConfig(CHUNK, impl)  # type: ignore[arg-type]
        return jax.jit(lambda *xs: gated_delta_chunked(*xs, config))

    return dict(heads=h, dk=dk, dv=dv), make, (q, k, v, g, beta, state)


def ssd_case() -> tuple[dict, Callable, tuple]:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.mamba2_ssd import Mamba2Config, ssd_chunked

    h, groups, p, n = (4, 2, 16, 16) if REHEARSE else (64, 8, 64, 128)
    keys = jax.random.split(jax.random.key(1), 6)
    x = jax.random.normal(keys[0], (S, h, p), jnp.bfloat16)
    dt = jax.nn.softplus(jax.random.normal(keys[1], (S, h)) - 2.0)
    A = -jnp.exp(jax.random.uniform(keys[2], (h,), jnp.float32, 0.0, 2.7))
    B = jax.random.normal(keys[3], (S, groups, n), jnp.bfloat16)
    C = jax.random.normal(keys[4], (S, groups, n), jnp.bfloat16)
    state = jax.random.normal(keys[5], (h, p, n), jnp.float32)

    def make(impl: str) -> Callable:
        config = Mamba2Config(CHUNK, impl)  # type: ignore[arg-type]
        return jax.jit(lambda *xs: ssd_chunked(*xs, config))

    return dict(heads=h, groups=groups, p=p, n=n), make, (x, dt, A, B, C, state)


def main() -> None:
    import jax
    import jax.numpy as jnp

    for kernel, case in (("gated_delta", gated_delta_case), ("ssd", ssd_case)):
        shape, make, args = case()
        outs = {}
        for impl in ("jnp", "pallas"):
            fn = make(impl)
            try:
                t = time.perf_counter()
                jax.block_until_ready(fn(*args))
                compile_s = time.perf_counter() - t
                ts = []
                for _ in range(5):
                    t = time.perf_counter()
                    outs[impl] = jax.block_until_ready(fn(*args))
                    ts.append(time.perf_counter() - t)
            except Exception as e:  # a kernel that fails on the GPU is a result, not a crash
                result("6_recurrent", kernel=kernel, impl=impl, failed=f"{type(e).__name__}: {str(e)[:400]}")
                continue
            diff = {}
            if impl != "jnp" and "jnp" in outs:
                diff = {
                    "max_diff_out": float(jnp.max(jnp.abs(outs[impl][0] - outs["jnp"][0]))),
                    "max_diff_state": float(jnp.max(jnp.abs(outs[impl][1] - outs["jnp"][1]))),
                }
            ms = 1e3 * sorted(ts)[2]
            result("6_recurrent", kernel=kernel, impl=impl, tokens=S, chunk=CHUNK, **shape,
                   compile_s=round(compile_s, 2), ms=round(ms, 3), **diff)  # fmt: skip


if __name__ == "__main__":
    main()
