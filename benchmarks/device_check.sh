#!/usr/bin/env bash
# The one prepared GPU check (run it through the device tool when a session has a GPU):
#   bash benchmarks/device_check.sh
# 1. environment; 2. the kernel test bodies against the compiled (non-interpret) Pallas kernels
# (IMPLS["pallas_gpu"] is added when jax's backend is "gpu"); 3. LLM end to end with the Pallas
# backend == the reference backend (greedy tokens); 4. benchmarks/kernels.py (its own GPU
# correctness checks, then the timing table). Sized to fit ~12 minutes of a 15-minute budget.
# Logs go to $OUT (the device tool's output folder) or /tmp/device_check.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/device_check}"
mkdir -p "$OUT"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  2>&1 | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/env.txt"

timeout 200 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels -k "pallas_gpu" \
  2>&1 | tee "$OUT/kernel_tests.txt"

timeout 150 python3 - <<'PY' 2>&1 | tee "$OUT/e2e_backends.txt"
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
    t0 = time.perf_counter(); llm.warmup(); t1 = time.perf_counter()
    outs[backend] = llm.generate(prompts, sp)
    t2 = time.perf_counter()
    print(f"{backend}: warmup {t1 - t0:.1f}s, generate {t2 - t1:.2f}s, stats {llm.stats()['prefix_hit_rate']:.2f} hit")
same = sum(a.token_ids == b.token_ids for a, b in zip(outs["reference"], outs["pallas"]))
worst = max(float(np.max(np.abs(np.array(a.logprobs) - b.logprobs)))
            for a, b in zip(outs["reference"], outs["pallas"]))
print(f"greedy tokens equal for {same}/{len(prompts)} requests; max |dlogprob| {worst:.2e}")
PY

timeout 480 python3 benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.md"
