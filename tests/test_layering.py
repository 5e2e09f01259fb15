"""Layering: scheduler never imports jax; pallas_kernels never imports the other packages."""

from __future__ import annotations

import subprocess
import sys


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return {name.split(".")[0] for name in out.stdout.split()}


def test_scheduler_does_not_import_jax():
    loaded = _loaded_after_import("scheduler")
    assert not loaded & {"jax", "jaxlib", "flax", "chex", "tokenspeed_jax", "pallas_kernels"}


def test_pallas_kernels_imports_only_jax():
    loaded = _loaded_after_import("pallas_kernels")
    assert "jax" in loaded
    assert not loaded & {"scheduler", "tokenspeed_jax", "flax"}


def test_cli_and_load_generator_do_not_import_jax():
    """The CLI's parsing, the workload definition and `bench serve`'s HTTP load generator load
    without jax (`tokenspeed_jax/__init__` imports LLM on first use only)."""
    loaded = _loaded_after_import("tokenspeed_jax.cli, tokenspeed_jax.bench_serve, "
                                  "tokenspeed_jax.server.loadgen, tokenspeed_jax.workload")
    assert not loaded & {"jax", "jaxlib", "flax", "pallas_kernels"}
