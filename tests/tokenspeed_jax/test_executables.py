"""runtime/executables.py + runtime/step_programs.py: serialized step executables (a warm start
neither traces nor compiles), keys that miss on any change of the program, corrupt entries,
ahead-of-time compiles in a thread pool, and lazily compiled shapes that never stall a step."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.runtime import executables
from tokenspeed_jax.runtime.executables import ExecutableStore
from tokenspeed_jax.runtime.shapes import StepShape

ROOT = pathlib.Path(__file__).resolve().parents[2]
# one token bucket (16; no 1-token bucket) x 3 kv buckets: 3 step shapes per engine to compile
SMALL = dict(
    page_size=4,
    max_batch_requests=2,
    max_scheduled_tokens=16,
    min_token_bucket=16,
    max_context_len=64,
    min_kv_bucket=16,
)

_CHILD = """
import json, sys
from tokenspeed_jax import LLM, SamplingParams
llm = LLM("tiny-random", page_size=4, num_pages=64, max_batch_requests=2, max_scheduled_tokens=16,
          max_context_len=32, dtype=sys.argv[2], compile_cache_dir=sys.argv[1])
ready = llm.warmup()
out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6))[0]
st = llm.startup_stats()
print(json.dumps({"tokens": out.token_ids, "ready": ready, "compiles": llm.stats()["num_compiles"],
                  "compiled": st["shapes_compiled"], "loaded": st["shapes_loaded"]}))
"""


def _start(cache: pathlib.Path, dtype: str = "float32") -> dict:
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


def _exes(cache: pathlib.Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in (cache / "executables").glob("*.exe")}


def test_program_key_changes_with_config_dtype_and_pool(tmp_path):
    keys = {}
    for name, kw in {
        "f32": dict(num_pages=32),
        "again": dict(num_pages=32),
        "bf16": dict(num_pages=32, dtype="bfloat16"),
        "pool": dict(num_pages=40),
        "seed": dict(num_pages=32, seed=1),
    }.items():
        llm = LLM("tiny-random", compile_cache_dir=str(tmp_path), **SMALL, **kw)
        runner = llm.engine.runner
        keys[name] = runner._program_key(StepShape(16, 0))
        keys[name + "/level"] = runner._program_key(StepShape(16, 1))
    assert keys["f32"] == keys["again"]  # the same program: the same key
    assert keys["seed"] == keys["f32"]  # weights are arguments, not part of the program
    distinct = [keys[k] for k in ("f32", "bf16", "pool", "f32/level")]
    assert len(set(distinct)) == len(distinct)


def test_environment_covers_versions_devices_and_source():
    env = executables.environment()
    assert {"jax", "jaxlib", "platform", "devices", "xla_flags", "source"} <= set(env)
    assert len(executables.source_digest()) == 64


AVX2 = "flags\t\t: fpu sse2 avx avx2 fma bmi2\n"
AVX512 = "flags\t\t: fpu sse2 avx avx2 fma bmi2 avx512f avx512bw avx512_bf16\n"


def test_key_on_cpu_includes_the_cpu_features(monkeypatch):
    """An executable compiled for an AVX-512 host must not be offered to an AVX2 host sharing
    the cache directory: different feature flags, different keys; the same flags (in any order),
    the same key."""
    assert executables.cpu_features(AVX2) != executables.cpu_features(AVX512)
    assert executables.cpu_features(AVX2) == executables.cpu_features(
        "flags\t\t: bmi2 fma avx2 avx sse2 fpu\n"
    )
    # this host: its own /proc/cpuinfo flags line is in the environment of every key
    assert executables.environment()["cpu_features"] == executables.cpu_features(
        executables._cpu_flags_line()
    )
    program = {"config": "tiny", "shape": "16x0"}
    keys = {}
    monkeypatch.setitem(executables._memo, "cpu", "")  # undone after the test: the real memo
    for name, line in (("avx2", AVX2), ("avx512", AVX512), ("avx2 again", AVX2)):
        monkeypatch.setattr(executables, "_cpu_flags_line", lambda line=line: line)
        del executables._memo["cpu"]  # read the (faked) host's flags afresh, as a new process
        keys[name] = executables.program_key(program)
    assert keys["avx2"] != keys["avx512"]
    assert keys["avx2"] == keys["avx2 again"]


def test_warm_llm_loads_every_shape_and_generates_the_same(tmp_path):
    sp = SamplingParams(max_tokens=5, logprobs=True)
    cold = LLM("tiny-random", num_pages=32, compile_cache_dir=str(tmp_path), **SMALL)
    n = cold.warmup()
    runner = cold.engine.runner
    assert n == len(runner.shape_keys) and runner.num_compiles == n and cold.warmup() == 0
    ref = cold.generate([[3, 4, 5, 6, 7, 8]], sp)[0]
    warm = LLM("tiny-random", num_pages=32, compile_cache_dir=str(tmp_path), **SMALL)
    assert warm.warmup() == n
    st = warm.startup_stats()
    assert st["shapes_loaded"] == n and st["shapes_compiled"] == 0 and st["trace_s"] == 0.0
    assert warm.engine.runner.num_compiles == 0  # nothing traced
    out = warm.generate([[3, 4, 5, 6, 7, 8]], sp)[0]
    assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs
    assert {s["source"] for s in st["shapes"]} == {"loaded"} and len(st["shapes"]) == n
    # An executable JAX's persistent cache served loses its compiled functions when serialized
    # (jaxlib 0.10 CPU: the loaded copy failed its first step, "Function wrapped_iota not
    # found"). With the store emptied, a start meets JAX's cache entries and stores fresh
    # compiles instead; the next start loads them and generates the same.
    shutil.rmtree(tmp_path / "executables")
    again = LLM("tiny-random", num_pages=32, compile_cache_dir=str(tmp_path), **SMALL)
    assert again.warmup() == n and again.startup_stats()["shapes_loaded"] == 0
    assert len(list((tmp_path / "executables").glob("*.exe"))) == n
    third = LLM("tiny-random", num_pages=32, compile_cache_dir=str(tmp_path), **SMALL)
    assert third.warmup() == n and third.startup_stats()["shapes_loaded"] == n
    out = third.generate([[3, 4, 5, 6, 7, 8]], sp)[0]
    assert out.token_ids == ref.token_ids


def test_unreadable_entry_is_deleted_and_compiled_afresh(tmp_path):
    store = ExecutableStore(str(tmp_path))
    llm = LLM("tiny-random", num_pages=32, compile_cache_dir=False, **SMALL)
    runner = llm.engine.runner
    shape = StepShape(16, 0)
    key = runner._program_key(shape)
    compiled = runner._lower(shape).compile()
    assert store.save(key, compiled) and store.load(key) is not None
    path = pathlib.Path(store.path(key))
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert store.load(key) is None and not path.exists()
    assert store.load("no-such-key") is None


def test_lazy_shape_runs_as_a_ready_cover_while_it_compiles_in_the_background():
    prompt = list(range(3, 40))  # 37 tokens: prefill needs the 16-token bucket, kv level > 0
    sp = SamplingParams(max_tokens=6, logprobs=True)
    exact = LLM("tiny-random", num_pages=64, compile_cache_dir=False, lazy_compile="sync", **SMALL)
    ref = exact.generate([prompt], sp)[0]
    llm = LLM("tiny-random", num_pages=64, compile_cache_dir=False, **SMALL)
    programs = llm.engine.runner.programs
    top = max(llm.engine.runner.shapes.warmup_shapes(llm.engine.scheduler.padding_ops()))
    programs.prepare(top)  # only the largest shape: it covers every step
    out = llm.generate([prompt], sp)[0]
    programs.wait_background()
    assert out.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-4
    bg = [r for r in programs.records if r.background]
    assert bg, "no step shape was compiled in the background"
    assert all(r.shape < top for r in bg)


def test_bad_lazy_compile_option():
    with pytest.raises(ValueError, match="lazy_compile"):
        LLM("tiny-random", num_pages=32, compile_cache_dir=False, lazy_compile="eager", **SMALL)


@pytest.mark.slow
def test_restart_loads_executables_corrupt_ones_heal_and_bf16_misses(tmp_path):
    cache = tmp_path / "cache"
    cold = _start(cache)
    first = _exes(cache)
    assert cold["compiled"] == cold["ready"] == len(first) > 0 and cold["loaded"] == 0
    warm = _start(cache)
    assert warm["tokens"] == cold["tokens"] and warm["compiles"] == 0
    assert warm["loaded"] == len(first) and warm["compiled"] == 0 and _exes(cache) == first
    victim = sorted(first)[0]
    path = cache / "executables" / victim
    path.write_bytes(path.read_bytes()[:64])
    healed = _start(cache)
    assert healed["tokens"] == cold["tokens"]
    assert healed["compiled"] == 1 and healed["loaded"] == len(first) - 1
    assert set(_exes(cache)) == set(first) and path.stat().st_size > 64
    bf16 = _start(cache, "bfloat16")  # another program: never a float32 entry
    assert bf16["loaded"] == 0 and bf16["compiled"] == bf16["ready"]
    assert len(_exes(cache)) == 2 * len(first)
