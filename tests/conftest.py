"""Session-wide test setup: the persistent compilation cache (on by default for every `LLM`)
points at a fresh temporary directory, so a test run neither reads nor fills the user's cache and
every run starts cold; the worker subprocesses (and pytest-xdist's workers) inherit it through
the environment, so shapes one test compiled are read back by the next."""

from __future__ import annotations

import os
import shutil
import tempfile

from tokenspeed_jax.runtime.compile_cache import ENV_CACHE_DIR

_made: list[str] = []


def pytest_configure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(ENV_CACHE_DIR):
        return  # an xdist worker: share the controller's directory (writes are atomic renames)
    path = tempfile.mkdtemp(prefix="tokenspeed-jax-test-cache-")
    _made.append(path)
    os.environ[ENV_CACHE_DIR] = path


def pytest_unconfigure(config) -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
