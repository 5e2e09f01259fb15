#!/usr/bin/env bash
# Every peer comparison of issue 44, one after another, on one quiet machine (~1.5-2 h on 2 cores).
#
#   VLLM_PYTHON=/path/vllm-venv/bin/python LLAMA_PYTHON=/path/lcpp-venv/bin/python \
#       bash benchmarks/peers.sh [OUT_DIR]
#
# Peers as ../shared/peers/ installs them (vLLM CPU 0.32.0, llama-cpp-python 0.3.36); a missing
# peer leaves its column "-". The SmolLM2 HF dir is written once by benchmarks/smollm2_hf.py.
# Each benchmark's table goes to OUT_DIR/NAME.log (default /tmp/tokenspeed-peers); a failed one
# is reported and the rest still run. The CPU line heads every table.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-/tmp/tokenspeed-peers}
mkdir -p "$out"
py=${PYTHON:-python}
model=$("$py" "$here/smollm2_hf.py") || { echo "cannot write the SmolLM2 HF dir"; exit 1; }
vllm=(); [ -n "${VLLM_PYTHON:-}" ] && vllm=(--vllm-python "$VLLM_PYTHON")
llama=(); [ -n "${LLAMA_PYTHON:-}" ] && llama=(--llama-python "$LLAMA_PYTHON")
step() {  # step NAME ARGS...: one benchmark, its output to OUT_DIR/NAME.log
  local name=$1; shift
  echo "$(date -u +%H:%M:%S) $name: $*"
  if "$py" "$@" > "$out/$name.log" 2>&1; then echo "  ok"; else echo "  FAILED (rc $?): $out/$name.log"; fi
}
step vs_vllm_chat "$here/vs_vllm.py" --model "$model" "${vllm[@]}" --dtypes float32,bfloat16 \
  --engines ours,ours+unrolled,vllm,vllm-both --kv-cache-gib 2
step vs_vllm_random "$here/vs_vllm.py" --model "$model" "${vllm[@]}" --dtypes float32,bfloat16 \
  --workload random
step serve_f32 "$here/vs_vllm_serve.py" --model "$model" "${vllm[@]}" --dtype float32
step batch1 "$here/batch1.py" --model "$model"
step gguf_vs_llama "$here/quantization.py" --model smollm2-135m "${llama[@]}" \
  --configs auto/none,auto/gguf
step spec_decode "$here/spec_decode.py" --model "$model" --policies cost,padding:4
step serve_bf16 "$here/vs_vllm_serve.py" --model "$model" "${vllm[@]}" --dtype bfloat16
step startup "$here/startup.py" --model "$model" --max-context-len 2048 --max-batch-requests 64 \
  --max-scheduled-tokens 2048 --also-unrolled "${vllm[@]}"
echo "$(date -u +%H:%M:%S) done: $out"
