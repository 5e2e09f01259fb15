"""Kernel benchmark (issue 5): our ragged paged attention vs JAX's Pallas GPU paged_attention.

One GPU run (< 8 minutes on an H200):
  1. correctness ON THE GPU: ours vs `paged_attention_reference` on a mixed batch with holes, a
     sliding window, soft cap, sinks and NaN in the null page / unused pages; ours vs JAX's kernel
     on a decode batch; short_conv vs its reference;
  2. timings (median per call over repeated back-to-back launches, do_bench style: warmup,
     block_until_ready) printed as a markdown table:
     - decode, batch 64, context 8k and 32k, bf16, 32 q heads / 8 kv heads, head dim 128,
       page 16 and 32: ours vs `jax.experimental.pallas.ops.gpu.paged_attention` (same values,
       adapted to its [Hkv, P, page, D] layout and [B, pages] tables);
     - decode with a 4k sliding window over 32k context (JAX's kernel has no window: it must
       read all 32k; ours skips the pages before the window);
     - a mixed batch: 4 prefill chunks of 512 tokens (at 4k context) + 60 decodes at 8k;
     - a few tuning variants of ours at 32k decode (tile size, kv_splits, stages).
  "HBM %" = bytes of in-window K/V (each needed token's K and V once) / time / peak bandwidth.

    python benchmarks/kernels.py              # GPU
    python benchmarks/kernels.py --smoke      # tiny shapes, Pallas interpret mode, runs on CPU
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (
    PagedAttentionConfig,
    paged_attention,
    paged_attention_reference,
    short_conv,
    short_conv_reference,
)


def bench(fn, *args, reps: int, inner: int) -> float:
    """Median seconds per call: `inner` calls enqueued back to back (hides dispatch), `reps`
    times, after compile + warmup."""
    jax.block_until_ready(fn(*args))
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def make_batch(key, *, q_lens, kv_lens, page_size, hkv, hq, d, dtype, extra_pages=8,
               shuffle=True):
    """Pools + page table for a batch; page ids shuffled (fragmented pool), page 0 = null."""
    pages_per = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(pages_per) + extra_pages
    max_pages = max(pages_per)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    shape = (num_pages, page_size, hkv, d)
    k_pages = jax.random.normal(k1, shape, dtype)
    v_pages = jax.random.normal(k2, shape, dtype)
    ids = np.arange(1, num_pages)
    if shuffle:
        ids = np.asarray(jax.random.permutation(k3, ids))
    table = np.zeros((len(kv_lens), max_pages), np.int32)
    i = 0
    for s, n in enumerate(pages_per):
        table[s, :n] = ids[i : i + n]
        i += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jax.random.normal(k4, (int(cu[-1]), hq, d), dtype)
    return (q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(cu), jnp.asarray([len(kv_lens)], jnp.int32))


def window_bytes(q_lens, kv_lens, window, hkv, d, itemsize):
    total = 0
    for ql, kv in zip(q_lens, kv_lens, strict=True):
        lo = 0 if window is None else max(0, kv - ql - window + 1)
        total += kv - lo
    return total * hkv * d * itemsize * 2


def jax_kernel_fn(args, *, interpret: bool, pages_per_compute_block: int, k_splits: int):
    """JAX's decode-only kernel on the same values: pools [Hkv, P, page, D], tables [B, pages]."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    q, k_pages, v_pages, table, kv_lens, _, _ = args
    kt, vt = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k_pages, v_pages))
    fn = jax.jit(functools.partial(jax_pa.paged_attention, interpret=interpret,
                                   pages_per_compute_block=pages_per_compute_block,
                                   k_splits=k_splits))
    return fn, (q, kt, vt, table, kv_lens)


def check_correctness(interpret: bool, small: bool) -> None:
    key = jax.random.PRNGKey(1)
    ps, hkv, hq, d = 16, 2, 8, 128 if not small else 64
    q_lens, kv_lens = ([1, 37, 1, 5], [300, 37, 90, 200]) if not small else ([1, 5], [40, 5])
    args = list(make_batch(key, q_lens=q_lens, kv_lens=kv_lens, page_size=ps, hkv=hkv, hq=hq,
                           d=d, dtype=jnp.bfloat16))
    window = 64 if not small else 16
    # Holes at slid-out slots, NaN in the null page and the spare pages.
    table = np.asarray(args[3]).copy()
    for s, (ql, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        lo = max(0, kv - ql - window + 1)
        table[s, : lo // ps] = 0
    used = np.unique(table)
    spare = np.setdiff1d(np.arange(args[1].shape[0]), used[used > 0])
    args[1] = args[1].at[spare].set(jnp.nan)
    args[2] = args[2].at[spare].set(jnp.nan)
    args[3] = jnp.asarray(table)
    kw = dict(sliding_window=window, soft_cap=30.0, sinks=jnp.linspace(-1, 1, hq))
    ours = jax.jit(functools.partial(paged_attention, interpret=interpret, **kw))(*args)
    ref = jax.jit(functools.partial(paged_attention_reference, **kw))(*args)
    err = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - ref.astype(jnp.float32))))
    print(f"correctness: ours vs reference (bf16, window, cap, sinks, holes, NaN): "
          f"max |diff| = {err:.2e}")
    assert bool(jnp.all(jnp.isfinite(ours))) and err < 3e-2, err

    dec = make_batch(key, q_lens=[1] * 4, kv_lens=[256, 100, 31, 256], page_size=ps, hkv=hkv,
                     hq=hq, d=d, dtype=jnp.bfloat16)
    # JAX's kernel needs pages_per_sequence divisible by k_splits * pages_per_compute_block.
    fn, jargs = jax_kernel_fn(dec, interpret=interpret, pages_per_compute_block=4, k_splits=4)
    theirs = fn(*jargs)
    # JAX's kernel applies no 1/sqrt(D) logit scale: compare at sm_scale=1.
    ours = jax.jit(functools.partial(paged_attention, interpret=interpret, sm_scale=1.0))(*dec)
    err = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - theirs.astype(jnp.float32))))
    print(f"correctness: ours vs JAX paged_attention (bf16 decode): max |diff| = {err:.2e}")
    assert err < 3e-2, err

    c, conv_ps = (256, 16) if not small else (32, 8)
    x = jax.random.normal(key, (12, c), jnp.bfloat16)
    pool = jax.random.normal(key, (8, conv_ps, c), jnp.bfloat16)
    table = jnp.asarray([[1, 2, 3], [4, 5, 0]], jnp.int32)
    conv_args = (x, pool, table, jnp.asarray([30, 10], jnp.int32), jnp.asarray([0, 1, 12]),
                 jnp.asarray([2], jnp.int32), jax.random.normal(key, (3, c), jnp.bfloat16))
    got = short_conv(*conv_args, interpret=interpret)
    want = short_conv_reference(*conv_args)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    print(f"correctness: short_conv vs reference: max |diff| = {err:.2e}")
    assert err < 3e-2, err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in Pallas interpret mode (CPU)")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak, TB/s (H200)")
    ns = parser.parse_args()
    interpret = ns.smoke
    dev = jax.devices()[0]
    print(f"# kernels benchmark  {datetime.date.today()}  jax {jax.__version__}  "
          f"device: {dev.device_kind} ({dev.platform})")
    if not interpret and dev.platform != "gpu":
        print("no GPU: use --smoke to run tiny shapes in interpret mode")
        return 1
    check_correctness(interpret, small=ns.smoke)

    if ns.smoke:
        batch, ctxs, big, hkv, hq, d, reps, inner = 4, (64, 128), 128, 2, 8, 64, 2, 1
        window, pages, mixed = 32, (16,), ([32] * 2 + [1] * 2, [64] * 2 + [128] * 2)
    else:
        batch, ctxs, big, hkv, hq, d, reps, inner = 64, (8192, 32768), 32768, 8, 32, 128, 7, 5
        window, pages = 4096, (16, 32)
        mixed = ([512] * 4 + [1] * 60, [4096] * 4 + [8192] * 60)
    dtype, itemsize = jnp.bfloat16, 2
    rows = []

    def report(name, secs, nbytes, base=None):
        frac = nbytes / secs / (ns.peak_tbps * 1e12)
        vs = "" if base is None else f"{base / secs:.2f}x"
        rows.append(f"| {name} | {secs * 1e3:.3f} | {nbytes / secs / 1e12:.2f} | "
                    f"{100 * frac:.0f}% | {vs} |")
        print(rows[-1], flush=True)

    print("| case | ms | TB/s (in-window K/V) | HBM % | ours vs JAX |")
    print("|---|---|---|---|---|")
    key = jax.random.PRNGKey(0)
    for ps in pages:
        for ctx in ctxs:
            args = make_batch(key, q_lens=[1] * batch, kv_lens=[ctx] * batch, page_size=ps,
                              hkv=hkv, hq=hq, d=d, dtype=dtype)
            nbytes = window_bytes([1] * batch, [ctx] * batch, None, hkv, d, itemsize)
            # JAX's defaults-ish: 128-token compute blocks, up to 16 k-splits (must divide).
            ppcb = min(max(1, 128 // ps), ctx // ps)
            fn, jargs = jax_kernel_fn(args, interpret=interpret, pages_per_compute_block=ppcb,
                                      k_splits=max(1, min(16, ctx // ps // ppcb)))
            t_jax = bench(fn, *jargs, reps=reps, inner=inner)
            del jargs
            report(f"JAX paged_attention decode B={batch} ctx={ctx} page={ps}", t_jax, nbytes)
            ours = jax.jit(functools.partial(paged_attention, interpret=interpret))
            report(f"ours decode B={batch} ctx={ctx} page={ps}",
                   bench(ours, *args, reps=reps, inner=inner), nbytes, t_jax)
            if ctx == big:
                full_bytes = nbytes
                wins = jax.jit(functools.partial(paged_attention, interpret=interpret,
                                                 sliding_window=window))
                nbytes = window_bytes([1] * batch, [ctx] * batch, window, hkv, d, itemsize)
                report(f"ours decode window={window} ctx={ctx} page={ps}",
                       bench(wins, *args, reps=reps, inner=inner), nbytes, t_jax)
                print(f"(JAX's kernel cannot skip: it reads {full_bytes / 1e9:.2f} GB "
                      f"for the windowed case too)")
                if ps == pages[0] and not ns.smoke:
                    ppb = 64 // ps
                    for cfg in (PagedAttentionConfig(pages_per_block=ppb, block_q=4),
                                PagedAttentionConfig(pages_per_block=ppb, block_q=4, kv_splits=4),
                                PagedAttentionConfig(pages_per_block=2 * ppb, block_q=4,
                                                     kv_splits=2),
                                PagedAttentionConfig(pages_per_block=ppb, block_q=4, kv_splits=2,
                                                     num_stages=3)):
                        tuned = jax.jit(functools.partial(paged_attention, config=cfg))
                        report(f"ours decode ctx={ctx} page={ps} {cfg}",
                               bench(tuned, *args, reps=reps, inner=inner), full_bytes)
            del args

    q_lens, kv_lens = mixed
    args = make_batch(key, q_lens=q_lens, kv_lens=kv_lens, page_size=pages[0], hkv=hkv, hq=hq,
                      d=d, dtype=dtype)
    ours = jax.jit(functools.partial(paged_attention, interpret=interpret))
    report(f"ours mixed {q_lens.count(1)} decodes@{kv_lens[-1]} + "
           f"{len(q_lens) - q_lens.count(1)} prefill x{q_lens[0]}@{kv_lens[0]}",
           bench(ours, *args, reps=reps, inner=inner),
           window_bytes(q_lens, kv_lens, None, hkv, d, itemsize))
    print("\n".join(["", "table:", *rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
