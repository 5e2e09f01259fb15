"""What every step of `benchmarks/device_e2e.sh` shares: the sizes (Llama-3.1-8B on a GPU, tiny on
CPU under E2E_REHEARSE=1), where files go, and the `RESULT {json}` lines.

Each step prints `RESULT {"step": ..., ...}` lines and appends them to $OUT/results.jsonl; the
last step (`summary.py`) reads them all back and prints the table.
"""

from __future__ import annotations

import json
import os
import sys
import time

# `python benchmarks/device_e2e/x.py`: this checkout's packages, not another install's
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(__file__)]
sys.path.insert(0, ROOT)

REHEARSE = os.environ.get("E2E_REHEARSE", "") not in ("", "0")
OUT = os.environ.get("OUT") or "/tmp/device_e2e"
SCRATCH = os.environ.get("E2E_SCRATCH") or ("/dev/shm/tokenspeed-e2e" if os.path.isdir("/dev/shm") else OUT)
CKPT = os.path.join(SCRATCH, "ckpt")
CACHE = os.path.join(SCRATCH, "compile-cache")  # step 2 starts it empty, step 3 reads it
OURS_JSON = os.path.join(OUT, "ours_outputs.json")  # step 2's tokens, for steps 3 and 5

# Llama-3.1-8B's shapes (config.json of meta-llama/Llama-3.1-8B), and a tiny model of the same
# family for the CPU rehearsal
LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)  # fmt: skip
TINY = dict(LLAMA_8B, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)  # fmt: skip
MODEL = TINY if REHEARSE else LLAMA_8B

# the workload: rows of decode, prompt and decode lengths, the engine's caps
ROWS = (8, 4, 1) if REHEARSE else (64, 32, 1)
PROMPT_LEN = 48 if REHEARSE else 1000
DECODE_SHORT, DECODE_LONG = (4, 12) if REHEARSE else (16, 80)
CHECK_PROMPTS, CHECK_PROMPT_LEN, CHECK_TOKENS = (3, 24, 8) if REHEARSE else (4, 256, 32)
ENGINE = (
    # the GPU's dtype default (the checkpoint's) spelled out: on CPU the platform default is float32
    dict(
        dtype="auto",
        attention_backend="reference",
        max_batch_requests=8,
        max_scheduled_tokens=128,
        max_context_len=256,
        # a fixed pool: sized from free RAM (the CPU default), the cold and the warm process could
        # get different pools, i.e. different step shapes, and the warm one nothing to load (CI)
        kv_cache_memory_bytes=64 * 2**20,
    )  # fmt: skip
    if REHEARSE
    else dict(max_context_len=4096)  # the GPU defaults otherwise: dtype auto, 256 rows x 8192 tokens
)


def result(step: str, **fields) -> dict:
    """Print one `RESULT {json}` line and keep it in $OUT/results.jsonl."""
    rec = {"step": step, "rehearsal": REHEARSE, "time": time.strftime("%H:%M:%S"), **fields}
    line = json.dumps(rec, default=float)
    print("RESULT " + line, flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "results.jsonl"), "a") as f:
        f.write(line + "\n")
    return rec


def host_peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def kv_bytes_per_token(cfg: dict, itemsize: int = 2) -> int:
    """K and V of every layer for one token."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize


def param_count(cfg: dict) -> int:
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return L * layer + 2 * v * h + h
