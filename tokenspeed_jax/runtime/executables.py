"""Serialized step executables: a warm start loads each step shape's compiled program from disk
instead of tracing, lowering and compiling it again.

JAX's persistent compilation cache (`compile_cache`) skips only the XLA compile: a warm start
still traces and lowers the whole model once per step shape, which is most of what is left of a
warm start (benchmarks/README.md, "Start-up"). This store keeps what comes out of
`jit(...).lower(...).compile()` (`jax.experimental.serialize_executable`) under a key the runner
computes *before* tracing, so a hit costs one file read and one executable load.

The key (`program_key`) is a SHA-256 over everything that changes the program:
* the environment (`environment()`): the store's format, jax / jaxlib versions, the backend's
  platform and version, the device kinds and ids, `XLA_FLAGS` and the jax options that change
  lowering (x64, default matmul precision), and a digest of the source of our three packages
  (`scheduler`, `pallas_kernels`, `tokenspeed_jax`: any edit of a kernel or a model misses);
  on CPU also the host's instruction-set flags (`cpu_features()`): XLA:CPU compiles for the
  host it runs on, so without them a program compiled on an AVX-512 host could be offered to
  an AVX2 host sharing the cache directory and execute instructions that host lacks;
* what the runner passes: the model config, the cache layout, the step's input layout, the
  attention backend and the argument signature (tree structure, shape, dtype and sharding of
  every parameter and state array; so dtype, pool size and mesh are in it).

Entries live in `<cache dir>/executables/` (beside JAX's `xla/`). An entry that cannot be read
(truncated, corrupt, written by another jaxlib) is deleted and the shape compiled afresh. Loading
unpickles: like JAX's own cache, never point it at a directory others can write.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import platform
import tempfile
import threading
from typing import Any

import jax

logger = logging.getLogger(__name__)

FORMAT = 2  # bump when the entry layout or the key recipe changes
_PACKAGES = ("scheduler", "pallas_kernels", "tokenspeed_jax")
# jax options that change what a traced step lowers to
_JAX_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion")
_lock = threading.Lock()
_memo: dict[str, str] = {}


def source_digest() -> str:
    """SHA-256 over the .py and .cc files of our packages (path + bytes), once per process."""
    with _lock:
        if "source" in _memo:
            return _memo["source"]
        import importlib

        h = hashlib.sha256()
        for name in _PACKAGES:
            root = os.path.dirname(os.path.abspath(importlib.import_module(name).__file__ or ""))
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for fn in sorted(filenames):
                    if fn.endswith((".py", ".cc", ".h")):  # .cc, .h: native kernels (pallas_kernels)
                        path = os.path.join(dirpath, fn)
                        h.update(os.path.relpath(path, root).encode() + b"\0")
                        with open(path, "rb") as f:
                            h.update(f.read())
        _memo["source"] = h.hexdigest()
        return _memo["source"]


def _cpu_flags_line() -> str:
    """The host's feature line of /proc/cpuinfo ("flags" on x86, "Features" on arm64), else
    what `platform` knows (no /proc: another OS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def cpu_features(flags_line: str | None = None) -> str:
    """Digest of the CPU's feature flags (`flags_line`, default this host's) and architecture.
    The whole flags line, not a chosen few ISA flags: a flag we did not think of (a new AMX or
    AVX10 variant LLVM targets) then still separates two hosts; the cost of a flag that does not
    matter is a recompile, never a wrong program. Order-insensitive (the flags as a sorted set)."""
    if flags_line is None:
        with _lock:
            if "cpu" not in _memo:
                _memo["cpu"] = cpu_features(_cpu_flags_line())
            return _memo["cpu"]
    _, _, values = flags_line.partition(":")
    flags = " ".join(sorted(set((values or flags_line).split())))
    return hashlib.sha256(f"{platform.machine()}\0{flags}".encode()).hexdigest()[:20]


def environment(devices: list[Any] | None = None) -> dict[str, Any]:
    """What outside the runner changes a compiled program (see the module docstring)."""
    import jaxlib

    devices = list(devices) if devices is not None else jax.devices()[:1]
    client = devices[0].client
    env: dict[str, Any] = {
        "format": FORMAT,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": client.platform,
        "platform_version": client.platform_version,
        "devices": [(d.id, d.device_kind, d.process_index) for d in devices],
        "process_count": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        **{flag: str(getattr(jax.config, flag)) for flag in _JAX_FLAGS},
        "source": source_digest(),
    }
    if client.platform == "cpu":  # a CPU program is machine code for this host's ISA
        env["cpu_features"] = cpu_features()
    return env


_watch = threading.local()  # per compiling thread: whether JAX's persistent cache served it
_listening = False
_listen_lock = threading.Lock()


def _on_event(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits" and getattr(_watch, "on", False):
        _watch.hit = True


@contextlib.contextmanager
def persistent_cache_hits():
    """`with persistent_cache_hits() as hit:` ... compile ...; `hit()` then tells whether JAX's
    persistent compilation cache served a compile run in this thread inside the block.

    An executable that came out of that cache must not be serialized into the store: jaxlib
    0.10's CPU client serializes it without its compiled functions, and the loaded copy fails at
    its first run ("Function wrapped_iota not found"); the store compiles such a program afresh
    (`STORE_COMPILE_OPTIONS`) for itself."""
    global _listening
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
    _watch.on, _watch.hit = True, False
    try:
        yield lambda: bool(_watch.hit)
    finally:
        _watch.on = False


def no_persistent_cache_writes() -> contextlib.AbstractContextManager:
    """A block whose compiles (in this thread) write nothing into JAX's persistent cache: the
    store's own compile of a program that cache already holds is the store's, not a second
    entry there. A thread-local JAX config value; a JAX without it writes as usual."""
    from jax._src import config as jax_config

    state = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)
    return state(float("inf")) if callable(state) else contextlib.nullcontext()


# An XLA option at its default value: the program compiles the same, but under another key of
# JAX's persistent cache, so a program that cache already serves compiles afresh for the store
STORE_COMPILE_OPTIONS: dict[str, str | bool] = {"xla_embed_ir_in_executable": False}


def signature(tree: Any) -> str:
    """Tree structure + (shape, dtype, sharding) of every leaf of an argument pytree."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        parts.append(f"{tuple(x.shape)}:{x.dtype}:{getattr(x, 'sharding', None)}")
    return "\n".join(parts)


def program_key(program: dict[str, Any], devices: list[Any] | None = None) -> str:
    """The entry key of one program: SHA-256 of the environment plus `program` (a dict of
    strings / reprs the runner builds)."""
    text = repr(sorted(environment(devices).items())) + "\n" + repr(sorted(program.items()))
    return hashlib.sha256(text.encode()).hexdigest()


class ExecutableStore:
    """A directory of serialized compiled programs, one file per key.

    `load(key)` returns a ready `jax.stages.Compiled` or None (a miss, or an unreadable entry,
    which is deleted); `save(key, compiled)` writes atomically (temp file + rename), so a crash
    mid-write never leaves a half entry under the key. Thread-safe: loads and saves of different
    keys run concurrently (the warm-up's worker threads).
    """

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)

    def path(self, key: str) -> str:
        return os.path.join(self.root, f"step-{key[:40]}.exe")

    def load(self, key: str, devices: list[Any] | None = None) -> jax.stages.Compiled | None:
        from jax.experimental import serialize_executable

        path = self.path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:
            return None
        try:
            stored_key, payload, in_tree, out_tree = pickle.loads(blob)
            if stored_key != key:
                raise ValueError("key mismatch")
            return serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=devices
            )
        except Exception as e:  # noqa: BLE001 - unreadable for any reason: compile afresh
            logger.warning(
                "executable cache: unreadable entry %s (%s: %s); deleted, recompiling",
                path,
                type(e).__name__,
                e,
            )
            with contextlib.suppress(OSError):
                os.remove(path)
            return None

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Persist `compiled` under `key`; False (logged) when it cannot be serialized or written."""
        from jax.experimental import serialize_executable

        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            blob = pickle.dumps((key, payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, self.path(key))
            finally:
                with contextlib.suppress(OSError):
                    os.remove(tmp)  # gone after the rename; a leftover only on failure
        except Exception as e:  # noqa: BLE001 - a cache that cannot write still serves
            logger.warning("executable cache: could not save %s (%s: %s)", key[:12], type(e).__name__, e)
            return False
        return True

    def num_entries(self) -> int:
        return sum(1 for n in os.listdir(self.root) if n.endswith(".exe"))
