"""Native CPU kernels: the C++ sources in `pallas_kernels/native/`, compiled on first use with
the system C++ compiler against jaxlib's XLA FFI headers and registered as XLA:CPU custom calls.

Why C++ on the CPU at all: XLA:CPU runs a traced loop as a chain of small thunks, each with its
own dispatch cost, and a decode token's paged attention is a loop over its pages
(docs/performance.md, "CPU attention"). A plain loop over the same rows costs what the rows do.

The shared object is cached under `$TOKENSPEED_JAX_CACHE_DIR/native` (else
`$XDG_CACHE_HOME/tokenspeed-jax/native`, else `~/.cache/tokenspeed-jax/native`; the same root as
the compilation cache), named by a digest of the source, the compiler command and this CPU's
flags (the build targets this CPU: `-march=native`). Written atomically (temp file + rename), so
processes building at once never read a partial file. No compiler, or a failed build: `load`
returns None with the reason in `unavailable()`, and callers fall back to the jnp reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax

logger = logging.getLogger(__name__)

__all__ = ["SOURCE_DIR", "compile_check", "load", "unavailable"]

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
# name -> (source file, {FFI symbol: XLA custom-call target}, extra compiler flags)
_KERNELS: dict[str, tuple[str, dict[str, str], tuple[str, ...]]] = {
    "paged_attention": ("paged_attention.cc", {"TokenspeedPagedAttention": "tokenspeed_paged_attention"}, ()),
    "block_matmul": ("block_matmul.cc", {"TokenspeedBlockMatmul": "tokenspeed_block_matmul"}, ()),
    # the same source with its AMX tile product on the software model of the tiles
    # (native/amx_tiles.h): the AMX path's logic checked on any CPU (tests)
    "block_matmul_amx_model": (
        "block_matmul.cc",
        {"TokenspeedBlockMatmulAmxModel": "tokenspeed_block_matmul_amx_model"},
        ("-DTOKENSPEED_AMX_MODEL",),
    ),
}
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_why: dict[str, str] = {}


def _cache_root() -> str:
    if os.environ.get("TOKENSPEED_JAX_CACHE_DIR"):
        base = os.path.expanduser(os.environ["TOKENSPEED_JAX_CACHE_DIR"])
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "tokenspeed-jax")
    return os.path.join(os.path.abspath(base), "native")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler_command(extra: tuple[str, ...] = (), flags: tuple[str, ...] = _FLAGS) -> list[str]:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    return [cxx, *flags, *extra, f"-I{jax.ffi.include_dir()}", f"-I{SOURCE_DIR}"]


def compile_check(name: str, target_flags: tuple[str, ...]) -> None:
    """Compile kernel `name`'s source for another CPU (`target_flags`, e.g. the AMX ones:
    ("-march=sapphirerapids",)) without loading it: the code paths this CPU cannot run at least
    build. RuntimeError with the compiler's message when they do not."""
    source, _, extra = _KERNELS[name]
    flags = tuple(f for f in _FLAGS if f != "-march=native") + target_flags
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            *_compiler_command(extra, flags),
            os.path.join(SOURCE_DIR, source),
            "-o",
            os.path.join(d, "check.so"),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


def _build(name: str) -> str:
    """Path of the built shared object for kernel `name` (built now unless cached)."""
    source, _, extra = _KERNELS[name]
    src = os.path.join(SOURCE_DIR, source)
    cmd = [*_compiler_command(extra), src]
    text = b""
    for path in [src] + sorted(
        os.path.join(SOURCE_DIR, h) for h in os.listdir(SOURCE_DIR) if h.endswith(".h")
    ):  # the shared headers it may include
        with open(path, "rb") as f:
            text += f.read()
    key = hashlib.sha256(
        text
        + "\0".join(cmd).encode()
        + _cpu_flags().encode()
        + platform.machine().encode()
        + jax.__version__.encode()
    ).hexdigest()[:20]
    root = _cache_root()
    out = os.path.join(root, f"{name}-{key}.so")
    if os.path.exists(out):
        return out
    os.makedirs(root, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    logger.info("built native kernel %s -> %s", name, out)
    return out


def load(name: str) -> ctypes.CDLL | None:
    """Build (once per source / CPU), load and register native kernel `name`; None (and a log
    line) when it cannot be built here. Registration is process-wide and idempotent, so a
    serialized executable that calls the kernel loads once this has run."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib: ctypes.CDLL | None = None
        try:
            lib = ctypes.cdll.LoadLibrary(_build(name))
            for symbol, target in _KERNELS[name][1].items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            _why[name] = f"{type(e).__name__}: {e}"
            logger.warning("native CPU kernel %s unavailable, using the jnp reference: %s", name, _why[name])
            lib = None
        _loaded[name] = lib
        return lib


def unavailable(name: str) -> str | None:
    """Why `load(name)` returned None (None if it loaded or was not tried)."""
    return _why.get(name)
