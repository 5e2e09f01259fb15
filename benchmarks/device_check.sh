#!/usr/bin/env bash
# The one prepared GPU check, sized for a 15-minute device window (timeouts sum to 530 s):
#   bash benchmarks/device_check.sh
#  -. environment; stop unless jax's backend really is the GPU                        (<= 30 s)
#  0. every kernel variant compiled and run ONCE at tiny shapes: PASS/FAIL + first error lines
#                                                                                      (<= 60 s)
#  1. benchmarks/kernels.py: GPU correctness (non-fatal; kv_splits, > 4 GiB pool, JAX's kernel
#     wrapped so its failure cannot stop ours), then the timing table with the roofline column
#                                                                                      (<= 240 s)
#  2. the kernel test bodies against the compiled kernels (IMPLS["pallas_gpu"]), --maxfail=3
#                                                                                      (<= 120 s)
#  3. LLM end to end: Pallas backend vs reference backend, greedy tokens + logprobs    (<= 80 s)
# Each step's log goes to $OUT (the device tool's output folder) or /tmp/device_check; a step that
# fails or times out does not stop the next one.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/device_check}"
mkdir -p "$OUT"

step() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }

step "environment"
timeout 30 python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import sys
import jax
print("jax", jax.__version__, jax.devices())
if jax.default_backend() != "gpu":
    sys.exit(f"jax backend is {jax.default_backend()!r}, not 'gpu': nothing here would test the GPU")
PY
if [ "${PIPESTATUS[0]}" -ne 0 ]; then echo "ABORT: no GPU backend"; exit 1; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/env.txt"

step "0. compile + run every kernel variant at tiny shapes"
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/step0_compile.txt"
import functools, time, traceback
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import PagedAttentionConfig, paged_attention, short_conv

def batch(q_lens, kv_lens, ps=16, hkv=2, g=4, d=128, dtype=jnp.bfloat16):
    pages = [-(-kv // ps) for kv in kv_lens]
    n = sum(pages) + 2
    key = jax.random.PRNGKey(0)
    k = jax.random.normal(key, (n, ps, hkv, d), dtype)
    table = np.zeros((len(kv_lens), max(pages)), np.int32)
    i = 1
    for s, p in enumerate(pages):
        table[s, :p] = np.arange(i, i + p); i += p
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jax.random.normal(key, (int(cu[-1]), hkv * g, d), dtype)
    return (q, k, k, jnp.asarray(table), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu),
            jnp.asarray([len(kv_lens)], jnp.int32))

dec, mixed = batch([1] * 4, [300, 64, 17, 200]), batch([1, 40, 1], [500, 40, 64])
variants = {
    "decode default": (dec, {}),
    "decode kv_splits=4 stages=3": (dec, dict(config=PagedAttentionConfig(kv_splits=4, num_stages=3))),
    "decode 32-token tiles": (dec, dict(config=PagedAttentionConfig(pages_per_block=2))),
    "decode window + soft cap + sinks": (dec, dict(sliding_window=64, soft_cap=30.0,
                                                   sinks=jnp.zeros((8,), jnp.float32))),
    "mixed prefill + decode": (mixed, {}),
    "page 32": (batch([1] * 4, [300, 64, 17, 200], ps=32), {}),
    "f32 d=16 (tiny model)": (batch([1, 9], [40, 9], d=16, g=2, dtype=jnp.float32),
                              dict(sliding_window=16)),
}
for name, (args, kw) in variants.items():
    t0 = time.perf_counter()
    try:
        out = jax.block_until_ready(jax.jit(functools.partial(paged_attention, **kw))(*args))
        ok = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
        print(f"{'PASS' if ok else 'FAIL (non-finite)'} paged_attention {name} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    except Exception as e:
        print(f"FAIL paged_attention {name}: " + " / ".join(str(e).strip().splitlines()[:4]),
              flush=True)
try:
    x = jnp.ones((12, 3072), jnp.bfloat16)
    pool = jnp.ones((8, 16, 3072), jnp.bfloat16)
    args = (x, pool, jnp.asarray([[1, 2, 3], [4, 5, 0]], jnp.int32), jnp.asarray([30, 10]),
            jnp.asarray([0, 1, 12]), jnp.asarray([2]), jnp.ones((3, 3072), jnp.bfloat16))
    jax.block_until_ready(jax.jit(short_conv)(*args))
    print("PASS short_conv C=3072", flush=True)
except Exception as e:
    print("FAIL short_conv C=3072: " + " / ".join(str(e).strip().splitlines()[:4]), flush=True)
PY

step "1. kernels.py: GPU correctness (non-fatal) + timings vs roofline"
timeout 240 python3 benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.md"

step "2. kernel test bodies on the compiled kernels"
# -n 0: one process (the suite's xdist workers would each preallocate most of the GPU's memory)
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 120 python3 -m pytest -n 0 -q -p no:cacheprovider --maxfail=3 -rf \
  tests/pallas_kernels -k "pallas_gpu" 2>&1 | tail -40 | tee "$OUT/kernel_tests.txt"

step "3. end to end: Pallas backend vs reference backend"
timeout 80 python3 - <<'PY' 2>&1 | tee "$OUT/e2e_backends.txt"
import time
import numpy as np
from tokenspeed_jax import LLM, SamplingParams

rng = np.random.default_rng(0)
system = rng.integers(0, 256, 200).tolist()
prompts = [system + rng.integers(0, 256, int(n)).tolist() for n in rng.integers(5, 60, 16)]
sp = SamplingParams(max_tokens=32, logprobs=True, ignore_eos=True)
outs = {}
for backend in ("reference", "pallas"):
    llm = LLM("tiny-random", attention_backend=backend, num_pages=2048, page_size=16,
              max_batch_requests=16, max_scheduled_tokens=512)
    # no warmup(): cold, the reference backend's 24 shapes took 85 s on the H200 (2026-12-04);
    # the first generate compiles only the shapes it meets
    t0 = time.perf_counter(); outs[backend] = llm.generate(prompts, sp); t1 = time.perf_counter()
    llm.generate(prompts, sp); t2 = time.perf_counter()
    print(f"{backend}: first generate {t1 - t0:.1f}s (compiles), second {t2 - t1:.2f}s, "
          f"prefix hit {llm.stats()['prefix_hit_rate']:.2f}")
same = sum(a.token_ids == b.token_ids for a, b in zip(outs["reference"], outs["pallas"]))
worst = max(float(np.max(np.abs(np.array(a.logprobs) - b.logprobs)))
            for a, b in zip(outs["reference"], outs["pallas"]))
print(f"greedy tokens equal for {same}/{len(prompts)} requests; max |dlogprob| {worst:.2e}")
PY
step "done"
