"""Kernel benchmark: our ragged paged attention vs JAX's Pallas GPU paged_attention, against a
roofline model.

One GPU run (< 6 minutes on an H200):
  1. correctness ON THE GPU, each check non-fatal (a FAIL line, then the next check): ours vs
     `paged_attention_reference` on a mixed batch with holes, a sliding window, soft cap, sinks and
     NaN in the null page / unused pages; the same with kv_splits; a > 4 GiB pool (64-bit
     offsets); ours vs JAX's kernel on a decode batch (JAX's kernel failing is reported, never
     fatal to ours); short_conv vs its reference;
  2. timings (median per call over back-to-back launches after warmup) in a markdown table, each
     beside the roofline: the bytes that MUST move (in-window K/V once, Q, output) and the FLOPs,
     time = max(bytes / 4.3 TB/s, FLOPs / 989 TFLOP/s), and "% of limit" = roofline / measured;
     - decode, batch 64, context 8k and 32k, bf16, 32 q / 8 kv heads, head dim 128, page 16 and
       32: ours vs `jax.experimental.pallas.ops.gpu.paged_attention` (same values, adapted to its
       [Hkv, P, page, D] layout);
     - decode with a 4k sliding window over 32k context (ours skips the pages before the window);
     - a mixed batch: 4 prefill chunks of 512 tokens (at 4k context) + 60 decodes at 8k;
     - tuning variants of ours at 32k decode (tile size, kv_splits, stages).

    python benchmarks/kernels.py              # GPU
    python benchmarks/kernels.py --model      # no device: the roofline model's predictions only
    python benchmarks/kernels.py --smoke      # tiny shapes, Pallas interpret mode, runs on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (
    DECODE_TUNING_CANDIDATES,
    PagedAttentionConfig,
    default_config,
    mixed_config,
    paged_attention,
    paged_attention_reference,
    short_conv,
    short_conv_reference,
)

# ---------------------------------------------------------------------------------------------
# Roofline model (H200). LIMIT_BPS is the sustained-read ceiling a streaming kernel can reach
# (~90% of the 4.8 TB/s spec); PEAK_FLOPS is dense bf16 tensor-core peak.
LIMIT_BPS, SPEC_BPS, PEAK_FLOPS, SMS = 4.3e12, 4.8e12, 989e12, 132
LAUNCH_S = 3e-6  # GPU time per small XLA op launched back to back inside one jit
LATENCY_S = 1e-6  # DRAM round trip under load: bytes in flight needed = LIMIT_BPS * LATENCY_S
# Resident programs per SM from benchmarks/kernel_compile.py (148 regs/72 KiB decode; 176 regs
# x 8 warps prefill).
PROGRAMS_PER_SM = {"decode": 3, "prefill": 1}


def visible_keys(q_lens, kv_lens, window) -> list[int]:
    """Keys each query token attends to (causal, optional sliding window)."""
    out = []
    for ql, kv in zip(q_lens, kv_lens, strict=True):
        for i in range(ql):
            pos = kv - ql + i
            out.append(pos + 1 if window is None else min(window, pos + 1))
    return out


def kv_tokens(q_lens, kv_lens, window) -> int:
    """Distinct cached tokens some query of the request can see: each is read once per kv head."""
    total = 0
    for ql, kv in zip(q_lens, kv_lens, strict=True):
        lo = 0 if window is None else max(0, kv - ql - window + 1)
        total += kv - lo
    return total


def roofline(q_lens, kv_lens, window, *, hkv, hq, d, itemsize) -> tuple[float, float, float]:
    """(bytes that must move, FLOPs, roofline seconds)."""
    t = sum(q_lens)
    nbytes = kv_tokens(q_lens, kv_lens, window) * hkv * d * itemsize * 2 + 2 * t * hq * d * itemsize
    flops = 4.0 * hq * d * sum(visible_keys(q_lens, kv_lens, window))
    return nbytes, flops, max(nbytes / LIMIT_BPS, flops / PEAK_FLOPS)


def predicted_seconds(q_lens, kv_lens, window, *, page_size, hkv, hq, d, itemsize) -> float:
    """Model of OUR kernel at its default config: the roofline plus what the implementation adds.
    - launches: block metadata, output/partial init, the kernel, the split merge (LAUNCH_S each);
    - extra bytes: aliased output init, with kv_splits the float32 partials (init write, kernel
      write, merge read), page ids (4 B per page per kv-head program);
    - the last, partial wave: when fewer programs than needed to keep LIMIT_BPS * LATENCY_S bytes
      in flight remain (each keeps (stages - 1) K+V tiles in flight), that wave's bytes stream at
      the proportionally lower rate (uniform decode batches only; mixed batches skip this term).
    Compute overlaps memory (max of the two), at peak tensor-core rate: an upper bound for
    prefill-heavy cases."""
    t, s = sum(q_lens), len(q_lens)
    max_pages = -(-max(kv_lens) // page_size)
    cfg = default_config(t, s, page_size, hq // hkv, hkv, max_pages)
    nbytes, flops, _ = roofline(q_lens, kv_lens, window, hkv=hkv, hq=hq, d=d, itemsize=itemsize)
    extra = t * hq * d * itemsize  # zero-initialised aliased output
    launches = 3
    if cfg.kv_splits > 1:
        extra += 3 * cfg.kv_splits * t * hq * (d + 2) * 4
        launches += 1
    extra += sum(-(-kv // page_size) for kv in kv_lens) * hkv * 4
    mem_s = (nbytes + extra) / LIMIT_BPS
    decode = t <= 2 * s
    uniform = len(set(kv_lens)) == 1 and len(set(q_lens)) == 1
    if decode and uniform:
        programs = s * hkv * cfg.kv_splits
        resident = PROGRAMS_PER_SM["decode"] * SMS
        last = programs % resident
        tile_bytes = cfg.pages_per_block * page_size * d * itemsize * 2
        inflight_needed = LIMIT_BPS * LATENCY_S
        if last:
            rate = min(1.0, last * (cfg.num_stages - 1) * tile_bytes / inflight_needed)
            last_bytes = (nbytes + extra) * last / programs
            mem_s += last_bytes / LIMIT_BPS * (1 / rate - 1)
    return launches * LAUNCH_S + max(mem_s, flops / PEAK_FLOPS)


# ---------------------------------------------------------------------------------------------


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


def make_batch(
    key, *, q_lens, kv_lens, page_size, hkv, hq, d, dtype, extra_pages=8, shuffle=True, first_page=1
):
    """Pools + page table for a batch; page ids shuffled (fragmented pool), page 0 = null.
    `first_page` > 1 leaves the low pages unused (to put a batch at the top of a huge pool)."""
    pages_per = [-(-kv // page_size) for kv in kv_lens]
    num_pages = first_page + sum(pages_per) + extra_pages
    max_pages = max(pages_per)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    shape = (num_pages, page_size, hkv, d)
    k_pages = jax.random.normal(k1, shape, dtype)
    v_pages = jax.random.normal(k2, shape, dtype)
    ids = np.arange(first_page, num_pages)
    if shuffle:
        ids = np.asarray(jax.random.permutation(k3, ids))
    table = np.zeros((len(kv_lens), max_pages), np.int32)
    i = 0
    for s, n in enumerate(pages_per):
        table[s, :n] = ids[i : i + n]
        i += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jax.random.normal(k4, (int(cu[-1]), hq, d), dtype)
    return (
        q,
        k_pages,
        v_pages,
        jnp.asarray(table),
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(cu),
        jnp.asarray([len(kv_lens)], jnp.int32),
    )


def jax_kernel_fn(args, *, interpret: bool, pages_per_compute_block: int, k_splits: int):
    """JAX's decode-only kernel on the same values: pools [Hkv, P, page, D], tables [B, pages]."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    q, k_pages, v_pages, table, kv_lens, _, _ = args
    kt, vt = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k_pages, v_pages))
    fn = jax.jit(
        functools.partial(
            jax_pa.paged_attention,
            interpret=interpret,
            pages_per_compute_block=pages_per_compute_block,
            k_splits=k_splits,
        )
    )
    return fn, (q, kt, vt, table, kv_lens)


def _max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _check(name: str, fn, failures: list[str]) -> None:
    """Run one correctness check; a failure is printed (first lines) and recorded, not raised."""
    try:
        err, tol = fn()
        ok = np.isfinite(err) and err < tol
        print(f"{'PASS' if ok else 'FAIL'} {name}: max |diff| = {err:.2e} (tol {tol:.0e})", flush=True)
        if not ok:
            failures.append(name)
    except Exception as e:  # noqa: BLE001 - report and go on to the next check
        first = " / ".join(traceback.format_exception_only(e)[-1].strip().splitlines()[:3])
        print(f"FAIL {name}: {first[:400]}", flush=True)
        failures.append(name)


def check_correctness(interpret: bool, small: bool) -> list[str]:
    """Every check on the device; returns the names of the failed ones."""
    failures: list[str] = []
    key = jax.random.PRNGKey(1)
    ps, hkv, hq, d = 16, 2, 8, 128 if not small else 64
    q_lens, kv_lens = ([1, 37, 1, 5], [300, 37, 90, 200]) if not small else ([1, 5], [40, 5])
    args = list(
        make_batch(key, q_lens=q_lens, kv_lens=kv_lens, page_size=ps, hkv=hkv, hq=hq, d=d, dtype=jnp.bfloat16)
    )
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
    ref = jax.jit(functools.partial(paged_attention_reference, **kw))(*args)

    def vs_reference(config=None):
        out = jax.jit(functools.partial(paged_attention, interpret=interpret, config=config, **kw))(*args)
        return (_max_diff(out, ref) if bool(jnp.all(jnp.isfinite(out))) else float("nan")), 3e-2

    _check("ours vs reference (bf16, window, cap, sinks, holes, NaN)", vs_reference, failures)
    _check(
        "ours vs reference, kv_splits=4, 32-token tiles",
        lambda: vs_reference(PagedAttentionConfig(pages_per_block=2, block_q=4, kv_splits=4, num_stages=3)),
        failures,
    )

    def big_pool():
        # > 4 GiB per pool (bf16 [P, 16, 8, 128] = 32 KiB per page): the kernel must use 64-bit
        # offsets; the batch's pages sit at the top of the pool.
        first = (2**32 // (16 * 8 * 128 * 2)) + 64
        big = make_batch(
            key,
            q_lens=[1, 1, 3, 1],
            kv_lens=[700, 1024, 33, 512],
            page_size=16,
            hkv=8,
            hq=32,
            d=128,
            dtype=jnp.bfloat16,
            first_page=first,
        )
        assert big[1].nbytes > 2**32, big[1].nbytes
        out = jax.jit(functools.partial(paged_attention, interpret=interpret))(*big)
        want = jax.jit(paged_attention_reference)(*big)
        return _max_diff(out, want), 3e-2

    if not small:
        _check("ours vs reference, > 4 GiB pool (64-bit offsets)", big_pool, failures)

    def vs_jax():
        dec = make_batch(
            key,
            q_lens=[1] * 4,
            kv_lens=[256, 100, 31, 256],
            page_size=ps,
            hkv=hkv,
            hq=hq,
            d=d,
            dtype=jnp.bfloat16,
        )
        # JAX's kernel needs pages_per_sequence divisible by k_splits * pages_per_compute_block,
        # and applies no 1/sqrt(D) logit scale: compare at sm_scale=1.
        fn, jargs = jax_kernel_fn(dec, interpret=interpret, pages_per_compute_block=4, k_splits=4)
        theirs = fn(*jargs)
        ours = jax.jit(functools.partial(paged_attention, interpret=interpret, sm_scale=1.0))(*dec)
        return _max_diff(ours, theirs), 3e-2

    _check("ours vs JAX paged_attention (bf16 decode)", vs_jax, failures)

    def conv():
        c, conv_ps = (256, 16) if not small else (32, 8)
        x = jax.random.normal(key, (12, c), jnp.bfloat16)
        pool = jax.random.normal(key, (8, conv_ps, c), jnp.bfloat16)
        table = jnp.asarray([[1, 2, 3], [4, 5, 0]], jnp.int32)
        conv_args = (
            x,
            pool,
            table,
            jnp.asarray([30, 10], jnp.int32),
            jnp.asarray([0, 1, 12]),
            jnp.asarray([2], jnp.int32),
            jax.random.normal(key, (3, c), jnp.bfloat16),
        )
        return _max_diff(short_conv(*conv_args, interpret=interpret), short_conv_reference(*conv_args)), 3e-2

    _check("short_conv vs reference", conv, failures)
    return failures


def cases(smoke: bool):
    """(label, q_lens, kv_lens, window, page_size, with_jax) for the timing table."""
    if smoke:
        return [
            ("decode B=4 ctx=128 page=16", [1] * 4, [128] * 4, None, 16, True),
            ("decode window=32 ctx=128", [1] * 4, [128] * 4, 32, 16, False),
            ("mixed", [32] * 2 + [1] * 2, [64] * 2 + [128] * 2, None, 16, False),
        ]
    out = []
    for ps in (16, 32):
        for ctx in (8192, 32768):
            out.append((f"decode B=64 ctx={ctx // 1024}k page={ps}", [1] * 64, [ctx] * 64, None, ps, True))
        out.append((f"decode B=64 ctx=32k window=4096 page={ps}", [1] * 64, [32768] * 64, 4096, ps, False))
    out.append(
        (
            "mixed: 60 decodes@8k + 4 prefill x512@4k",
            [512] * 4 + [1] * 60,
            [4096] * 4 + [8192] * 60,
            None,
            16,
            False,
        )
    )
    # a serving step: one 512-token prefill chunk beside 31 running decodes
    out.append(
        ("mixed: 31 decodes@2k + 1 prefill x512", [512] + [1] * 31, [512] + [2048] * 31, None, 16, False)
    )
    return out


HEADS = dict(hkv=8, hq=32, d=128, itemsize=2)


def print_model() -> None:
    """The roofline model's predictions for every timed case (no device needed)."""
    print(
        "| case | must-move MB | GFLOP | roofline ms | predicted ms (ours) | "
        "predicted % of limit | predicted TB/s | % of 4.8 TB/s spec |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, q_lens, kv_lens, window, ps, _ in cases(smoke=False):
        nbytes, flops, roof = roofline(q_lens, kv_lens, window, **HEADS)
        pred = predicted_seconds(q_lens, kv_lens, window, page_size=ps, **HEADS)
        print(
            f"| {label} | {nbytes / 1e6:.0f} | {flops / 1e9:.0f} | {roof * 1e3:.3f} | "
            f"{pred * 1e3:.3f} | {100 * roof / pred:.0f}% | {nbytes / pred / 1e12:.2f} | "
            f"{100 * nbytes / pred / SPEC_BPS:.0f}% |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in Pallas interpret mode (CPU)")
    parser.add_argument(
        "--model", action="store_true", help="print the roofline model's predictions only (no device)"
    )
    parser.add_argument("--skip-correctness", action="store_true")
    ns = parser.parse_args()
    if ns.model:
        print_model()
        return 0
    interpret = ns.smoke
    dev = jax.devices()[0]
    print(
        f"# kernels benchmark  {datetime.date.today()}  jax {jax.__version__}  "
        f"device: {dev.device_kind} ({dev.platform})"
    )
    if not interpret and dev.platform != "gpu":
        print("no GPU: use --smoke (interpret mode) or --model (predictions only)")
        return 1
    failures = [] if ns.skip_correctness else check_correctness(interpret, small=ns.smoke)

    if ns.smoke:
        heads, reps, inner = dict(hkv=2, hq=8, d=64, itemsize=2), 2, 1
    else:
        heads, reps, inner = HEADS, 7, 5
    dtype = jnp.bfloat16
    rows = []

    def report(name, secs, roof, nbytes, base=None):
        vs = "" if base is None else f"{base / secs:.2f}x"
        rows.append(
            f"| {name} | {secs * 1e3:.4g} | {roof * 1e3:.4g} | {100 * roof / secs:.1f}% | "
            f"{nbytes / secs / 1e12:.2f} | {vs} |"
        )
        print(rows[-1], flush=True)

    print("| case | measured ms | roofline ms | % of limit | TB/s (must-move) | ours vs JAX |")
    print("|---|---|---|---|---|---|")
    key = jax.random.PRNGKey(0)
    hkv, hq, d = heads["hkv"], heads["hq"], heads["d"]
    for label, q_lens, kv_lens, window, ps, with_jax in cases(ns.smoke):
        args = make_batch(key, q_lens=q_lens, kv_lens=kv_lens, page_size=ps, hkv=hkv, hq=hq, d=d, dtype=dtype)
        nbytes, _, roof = roofline(q_lens, kv_lens, window, **heads)
        t_jax = None
        if with_jax:
            try:  # JAX's kernel failing must not stop ours
                ctx = kv_lens[0]
                ppcb = min(max(1, 128 // ps), ctx // ps)
                fn, jargs = jax_kernel_fn(
                    args,
                    interpret=interpret,
                    pages_per_compute_block=ppcb,
                    k_splits=max(1, min(16, ctx // ps // ppcb)),
                )
                t_jax = bench(fn, *jargs, reps=reps, inner=inner)
                del jargs
                report(f"JAX paged_attention {label}", t_jax, roof, nbytes)
            except Exception as e:  # noqa: BLE001
                print(f"| JAX paged_attention {label} | FAILED: {str(e).splitlines()[0][:200]} |")
        ours = jax.jit(functools.partial(paged_attention, interpret=interpret, sliding_window=window))
        report(f"ours {label}", bench(ours, *args, reps=reps, inner=inner), roof, nbytes, t_jax)
        if not ns.smoke and label == "decode B=64 ctx=32k page=16":
            for cfg in DECODE_TUNING_CANDIDATES:
                tuned = jax.jit(functools.partial(paged_attention, config=cfg))
                report(
                    f"ours {label} tile={cfg.pages_per_block * ps} stages={cfg.num_stages} "
                    f"splits={cfg.kv_splits}",
                    bench(tuned, *args, reps=reps, inner=inner),
                    roof,
                    nbytes,
                )
        if label.startswith("mixed"):
            # the default is two launches (MixedConfig, the decode launch unsplit); before
            # 2026-12-04 it was one launch at the prefill config
            t, s, mp = sum(q_lens), len(q_lens), -(-max(kv_lens) // ps)
            both = mixed_config(t, s, ps, hq // hkv, hkv, mp)
            assert both is not None
            split = default_config(s, s, ps, hq // hkv, hkv, mp).kv_splits
            variants = {
                "one launch (prefill config)": default_config(t, s, ps, hq // hkv, hkv, mp),
                f"two launches, decode kv_splits={split}": dataclasses.replace(
                    both, decode=dataclasses.replace(both.decode, kv_splits=split)
                ),
            }
            for name, cfg in variants.items():
                tuned = jax.jit(
                    functools.partial(paged_attention, interpret=interpret, sliding_window=window, config=cfg)
                )
                report(f"ours {label} {name}", bench(tuned, *args, reps=reps, inner=inner), roof, nbytes)
        del args
    print("\n".join(["", "table:", *rows]))
    if failures:
        print(f"correctness FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
