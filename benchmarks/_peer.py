"""What the benchmarks against peers share (vs_vllm.py, vs_vllm_serve.py, _llama_cpp.py): the
environment each engine's process runs in, whether vllm imports from the given interpreter, and
one timed engine per child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def vllm_env(kv_cache_gib: int | None = None) -> dict[str, str]:
    """No PYTHONPATH (vLLM's venv must not import this checkout), and vLLM's CPU KV cache at
    `kv_cache_gib` GiB (given: the same bytes as ours), else 4 unless set
    (../shared/peers/vllm-cpu.md)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
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


def run_child(python: str, script: str, kw: dict[str, Any], env: dict[str, str],
              label: str) -> Any | None:
    """Run `script` (source text) with `python` in a fresh temporary directory, argv[1] the
    path of `kw` as JSON; return the JSON after its last "RESULT " stdout line, or None (the
    child's stderr tail printed under `label`) when it fails or prints none."""
    with tempfile.TemporaryDirectory() as d:
        arg, path = os.path.join(d, "kw.json"), os.path.join(d, "child.py")
        with open(arg, "w") as f:
            json.dump(kw, f)
        with open(path, "w") as f:
            f.write(script)
        proc = subprocess.run([python, path, arg], env=env, capture_output=True, text=True,
                              cwd=d)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(f"{label} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT "):])
