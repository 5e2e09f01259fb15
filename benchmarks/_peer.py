"""What the benchmarks against vLLM CPU share (vs_vllm.py, vs_vllm_serve.py): the environment
each engine's process runs in, and whether vllm imports from the given interpreter."""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def vllm_env() -> dict[str, str]:
    """No PYTHONPATH (vLLM's venv must not import this checkout), and vLLM's CPU KV cache at
    4 GiB unless set (../shared/peers/vllm-cpu.md)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def vllm_importable(python: str | None) -> bool:
    """Whether `import vllm` works in `python` (False when None or no such interpreter)."""
    if not python:
        return False
    try:
        return subprocess.run([python, "-c", "import vllm"], env=vllm_env(),
                              capture_output=True).returncode == 0
    except OSError:
        return False
