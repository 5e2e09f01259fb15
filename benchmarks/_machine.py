"""One line naming the CPU a benchmark ran on: model, cores and the vector / matrix extensions
that decide which dot kernels XLA and torch can use (the same 2-core VM class has come as an
Intel Xeon with AVX-512 + AMX-BF16 and as an AMD EPYC with AVX2 only; bf16 ratios flip)."""

from __future__ import annotations

import os

_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_line() -> str:
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    have = [x for x in _FLAGS if x in flags] or ["no avx2"]
    return f"{model}, {os.cpu_count()} cores, {' '.join(have)}"
