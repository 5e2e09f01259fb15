"""The persistent compilation cache: every compiled step shape is written to a per-user directory,
so the next start on this machine reads the executables instead of compiling them again.

On by default for `LLM` and every command. Where: `$TOKENSPEED_JAX_CACHE_DIR`, else
`$XDG_CACHE_HOME/tokenspeed-jax`, else `~/.cache/tokenspeed-jax` (the XLA entries go to its
`xla/` folder). `LLM(compile_cache_dir=DIR)` / `--compile-cache-dir DIR` picks another one,
`compile_cache_dir=False` / `--no-compile-cache` turns it off.

JAX's cache is process-wide (one directory for every jit of the process), so the first `LLM`
that enables it decides; a later one asking for another directory moves the whole process there.
JAX keys each entry by everything that changes the program (the lowered module with its shapes
and dtypes, the compile options, the backend and device kind, the jax / jaxlib versions), so a
changed model config, dtype or step shape never reads a stale entry. An unwritable directory
warns once and the process runs uncached. An entry that cannot be read (truncated, corrupt) makes
JAX compile that shape again but not replace the entry, so it would miss at every start: `enable`
checks the entries written since its last check and deletes the unreadable ones (the next
compile writes them afresh).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import warnings

logger = logging.getLogger(__name__)

ENV_CACHE_DIR = "TOKENSPEED_JAX_CACHE_DIR"
_state: dict[str, str | None] = {"dir": None}
_warned: set[str] = set()
_CHECKED_STAMP = ".tokenspeed-checked"  # mtime = when `drop_unreadable` last scanned


def default_cache_dir() -> str:
    """`$TOKENSPEED_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenspeed-jax`, else
    `~/.cache/tokenspeed-jax`."""
    if os.environ.get(ENV_CACHE_DIR):
        return os.path.abspath(os.path.expanduser(os.environ[ENV_CACHE_DIR]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenspeed-jax")


def _writable(path: str) -> str | None:
    """None if `path` can hold cache entries, else why not."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def drop_unreadable(path: str) -> int:
    """Delete the entries of `path` that do not decompress (truncated or corrupt); returns how
    many. Only entries written since the last check are read (a stamp file records when it
    ran), so a start pays for the new entries, not for the whole cache of every model."""
    from jax._src import compilation_cache

    decompress = getattr(compilation_cache, "decompress_executable", None)
    if decompress is None or not os.path.isdir(path):  # another jax: leave the entries alone
        return 0
    stamp = os.path.join(path, _CHECKED_STAMP)
    try:
        since = os.stat(stamp).st_mtime_ns
    except OSError:
        since = 0
    began = time.time_ns()  # an entry written while this scan runs is checked next time
    dropped = 0
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.startswith(".") or not os.path.isfile(full):
            continue
        try:
            if os.stat(full).st_mtime_ns < since:
                continue  # checked by an earlier start and not written since
            with open(full, "rb") as f:
                decompress(f.read())
        except Exception:  # noqa: BLE001 - any failure to read or decode: JAX cannot use it
            with contextlib.suppress(OSError):
                os.remove(full)
                dropped += 1
    with contextlib.suppress(OSError):
        with open(stamp, "a"):
            pass
        os.utime(stamp, ns=(began, began))
    if dropped:
        logger.warning(
            "compilation cache %s: deleted %d unreadable entries (recompiled on use)", path, dropped
        )
    return dropped


def enable(cache_dir: str | bool | None = None) -> str | None:
    """Switch the persistent compilation cache on (None = `default_cache_dir()`, a path) or off
    (False); returns the XLA entry directory in use, or None when uncached."""
    import jax
    from jax._src import compilation_cache

    if cache_dir is False:
        if _state["dir"] is not None:
            jax.config.update("jax_compilation_cache_dir", None)
            compilation_cache.reset_cache()
            _state["dir"] = None
        return None
    root = default_cache_dir() if cache_dir is None or cache_dir is True else str(cache_dir)
    path = os.path.join(os.path.abspath(os.path.expanduser(root)), "xla")
    if _state["dir"] == path:
        return path
    problem = _writable(path)
    if problem is not None:
        if path not in _warned:
            _warned.add(path)
            warnings.warn(
                f"tokenspeed-jax: compilation cache dir {path} is not writable "
                f"({problem}); running without a persistent compilation cache "
                f"(set --compile-cache-dir / ${ENV_CACHE_DIR}, or --no-compile-cache)",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
    # Every step shape is worth persisting: the smallest compile here still takes ~0.5 s on a
    # 2-core host, and entries are a few MB at most.
    drop_unreadable(path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()  # a dir set after the first compile takes effect only so
    _state["dir"] = path
    logger.info("persistent compilation cache: %s", path)
    return path


def cache_dir_in_use() -> str | None:
    """The XLA entry directory `enable` switched on, or None."""
    return _state["dir"]


def num_entries(path: str | None = None) -> int:
    """Cache entries in `path` (default: the directory in use)."""
    path = path or _state["dir"]
    if path is None or not os.path.isdir(path):
        return 0
    return sum(1 for name in os.listdir(path) if not name.startswith("."))
