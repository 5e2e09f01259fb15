"""Compile every Pallas kernel variant for the H200 (sm_90a) on this machine, no GPU needed.

Lowering -> XLA's Triton pipeline -> PTX -> `ptxas -v`; prints a markdown table (grid, warps,
stages, registers, spills, shared memory, deepest cp.async.wait_group, blocks/SM, waves) and
exits non-zero if any variant fails a check (`pallas_kernels.compile_check.problems`).

    pip install -e '.[gpu-compile]'
    python benchmarks/kernel_compile.py          # full matrix (~1 min)
    python benchmarks/kernel_compile.py --quick  # the CI subset
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import jax

from pallas_kernels import compile_check, gpu_compile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one variant per kernel body")
    ns = parser.parse_args()
    reason = gpu_compile.missing()
    if reason:
        print(f"skipped: {reason}")
        return 1
    print(
        f"# kernel compile check  {datetime.date.today()}  jax {jax.__version__}  "
        f"target sm_90a ({compile_check.H200.name}, {compile_check.H200.sms} SMs)"
    )
    print(compile_check.HEADER)
    bad = []
    t0 = time.perf_counter()
    for v in compile_check.variants(full=not ns.quick):
        try:
            reports = compile_check.compile_variant(v)
        except Exception as e:  # report and go on: one broken variant must not hide the rest
            first = str(e).strip().splitlines()[:3]
            print(f"| {v.name} | FAILED: {' / '.join(first)} |", flush=True)
            bad.append(f"{v.name}: {first}")
            continue
        for r in reports:
            print(r.row(), flush=True)
            bad += compile_check.problems(r)
    print(
        f"\n{time.perf_counter() - t0:.0f} s; "
        + ("all checks pass" if not bad else "PROBLEMS:\n  " + "\n  ".join(bad))
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
