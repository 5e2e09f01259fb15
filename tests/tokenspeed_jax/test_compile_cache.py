"""runtime/compile_cache.py: the per-user default dir, flags, an unwritable dir, and (in fresh
processes, since JAX's cache is process-wide) warm starts, corrupt entries and changed configs."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import warnings

import pytest

from tokenspeed_jax.runtime import compile_cache

ROOT = pathlib.Path(__file__).resolve().parents[2]

# One small engine, one prompt, greedy: prints its tokens and how many step shapes it compiled.
_CHILD = """
import json, sys
from tokenspeed_jax import LLM, SamplingParams
llm = LLM("tiny-random", page_size=4, num_pages=64, max_batch_requests=2, max_scheduled_tokens=16,
          max_context_len=32, dtype=sys.argv[2], compile_cache_dir=sys.argv[1])
out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6))[0]
print(json.dumps({"tokens": out.token_ids, "dir": llm.compile_cache_dir}))
"""


def _start(cache: pathlib.Path, dtype: str = "float32") -> dict:
    # JAX's own cache is under test: drop the serialized executables (runtime/executables.py,
    # tests/tokenspeed_jax/test_executables.py), or a warm start would never read an XLA entry
    shutil.rmtree(cache / "executables", ignore_errors=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(cache), dtype],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _entries(cache: pathlib.Path) -> dict[str, float]:
    xla = cache / "xla"
    return {p.name: p.stat().st_mtime for p in xla.iterdir() if not p.name.startswith(".")}


def test_default_dir_follows_env_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV_CACHE_DIR, str(tmp_path / "mine"))
    assert compile_cache.default_cache_dir() == str(tmp_path / "mine")
    monkeypatch.delenv(compile_cache.ENV_CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_cache_dir() == str(tmp_path / "xdg" / "tokenspeed-jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_cache_dir() == str(tmp_path / "home" / ".cache" / "tokenspeed-jax")


def test_unwritable_dir_warns_once_and_runs_uncached(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    before = compile_cache.cache_dir_in_use()
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert compile_cache.enable(str(blocker)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no second warning
        assert compile_cache.enable(str(blocker)) is None
    assert compile_cache.cache_dir_in_use() == before  # the process's cache is left as it was


def test_drop_unreadable_reads_only_entries_written_since_its_last_check(tmp_path):
    bad = tmp_path / "jit_step-0-cache"
    bad.write_bytes(b"garbage")
    assert compile_cache.drop_unreadable(str(tmp_path)) == 1 and not bad.exists()
    bad.write_bytes(b"garbage")
    os.utime(bad, ns=(1, 1))  # older than the last check: not read again
    assert compile_cache.drop_unreadable(str(tmp_path)) == 0 and bad.exists()
    bad.write_bytes(b"garbage again")  # written since: read, and dropped
    assert compile_cache.drop_unreadable(str(tmp_path)) == 1 and not bad.exists()


def test_cli_flags_reach_the_llm():
    import argparse

    from tokenspeed_jax.cli.common import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p, num_pages=None)
    assert p.parse_args([]).compile_cache_dir is None
    assert p.parse_args(["--compile-cache-dir", "/x"]).compile_cache_dir == "/x"
    assert p.parse_args(["--no-compile-cache"]).compile_cache_dir is False


@pytest.mark.slow
def test_warm_start_reads_entries_corrupt_ones_recompile_and_new_configs_miss(tmp_path):
    cache = tmp_path / "cache"
    cold = _start(cache)
    assert cold["dir"] == str(cache / "xla")
    first = _entries(cache)
    assert first, "the cold start persisted no step shape"
    warm = _start(cache)
    assert warm["tokens"] == cold["tokens"]
    assert _entries(cache) == first  # every shape read back: nothing written again
    for name in first:  # truncate every entry: the next start must compile, not crash
        path = cache / "xla" / name
        path.write_bytes(path.read_bytes()[:7])
    again = _start(cache)
    assert again["tokens"] == cold["tokens"]
    rewritten = _entries(cache)
    assert set(rewritten) == set(first)  # the same keys, written afresh: whole entries again
    assert all((cache / "xla" / n).stat().st_size > 7 for n in rewritten)
    assert _start(cache)["tokens"] == cold["tokens"] and _entries(cache) == rewritten  # healed
    # another dtype is another program: its own entries, none of the float32 ones reused
    bf16 = _start(cache, "bfloat16")
    assert len(_entries(cache)) > len(rewritten)
    assert bf16["dir"] == str(cache / "xla")


@pytest.mark.slow
def test_warmup_command_fills_the_cache_then_finds_it_warm(tmp_path, capsys):
    from tokenspeed_jax import cli

    argv = [
        "warmup",
        "--num-pages",
        "64",
        "--page-size",
        "4",
        "--max-batch-requests",
        "2",
        "--max-scheduled-tokens",
        "16",
        "--max-context-len",
        "32",
        "--compile-cache-dir",
        str(tmp_path),
    ]
    try:
        assert cli.main(argv) == 0
        first = capsys.readouterr().out
        assert f"cache {tmp_path / 'xla'}:" in first and "(0 new)" not in first
        assert cli.main(argv) == 0
        second = capsys.readouterr().out
        assert "(0 new)" in second and " 0 compiled" in second  # every shape read back
    finally:
        compile_cache.enable(None)  # back to the session's cache dir
