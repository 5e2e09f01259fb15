"""The native (C++) CPU kernel's plumbing: build cache, fallback, pool kinds, bit pools.

Its numbers are checked by the shared bodies of test_paged_attention.py and
test_paged_attention_quantized.py (implementation "cpu_kv"), against the float64 oracle with NaN
in every byte it must not read."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native, paged_attention_cpu, paged_attention_reference
from tests.native_kernels import need_native
from tests.pallas_kernels.test_paged_attention import CASES, build


@pytest.fixture(autouse=True)
def _built() -> None:
    """Every test here needs the built kernel: fails under $TOKENSPEED_JAX_REQUIRE_NATIVE (CI)
    when it does not build, skips otherwise (`tests.native_kernels`)."""
    need_native("paged_attention")


def _jnp(args, kwargs):
    return (
        [jnp.asarray(a) for a in args],
        {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()},
    )


def test_built_once_into_the_cache_dir_named_by_source_and_cpu() -> None:
    path = native._build("paged_attention")
    assert path.startswith(native._cache_root()) and os.path.exists(path)
    mtime = os.stat(path).st_mtime_ns
    assert native._build("paged_attention") == path  # a second call reads the cache
    assert os.stat(path).st_mtime_ns == mtime
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".")], "temp left"


def test_failed_build_names_the_compiler_error(monkeypatch, tmp_path) -> None:
    bad = tmp_path / "cxx"
    bad.write_text("#!/bin/sh\necho 'cc1plus: fatal error: out of cheese' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    monkeypatch.setenv("TOKENSPEED_JAX_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="out of cheese"):
        native._build("paged_attention")
    assert os.listdir(tmp_path / "cache" / "native") == [], "no partial .so left behind"


def test_unavailable_kernel_falls_back_to_the_reference(monkeypatch) -> None:
    """No compiler: `load` says why, the backend resolves to the reference, and
    `paged_attention_cpu` computes the reference's result."""
    from tokenspeed_jax.runtime.backends import resolve_backend

    def fail(name: str) -> str:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why", {})
    monkeypatch.setattr(native, "_build", fail)
    assert native.load("paged_attention") is None
    assert "no C++ compiler" in (native.unavailable("paged_attention") or "")
    assert resolve_backend("native") == "reference"
    assert resolve_backend("auto") == "reference"
    args, kwargs = _jnp(*build(CASES["decode_ps16_g4"]))
    np.testing.assert_array_equal(
        np.asarray(paged_attention_cpu.paged_attention_cpu(*args, **kwargs)),
        np.asarray(paged_attention_reference(*args, **kwargs)),
    )


def test_auto_is_native_on_cpu() -> None:
    from tokenspeed_jax.runtime.backends import jnp_layout, resolve_backend

    assert resolve_backend("auto") == "native" and jnp_layout("native")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_backend("cpp")


def test_bf16_pools_as_bits_equal_bf16_pools() -> None:
    """The runtime stores bf16 pools as uint16 bits (pool_bits): same result as the pools
    themselves, and as the reference on the bits."""
    dtype = jnp.bfloat16
    args, kwargs = _jnp(*build(CASES["mixed_ps16_g8"]))
    q, k, v, *rest = args
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    bits = [jax.lax.bitcast_convert_type(a, jnp.uint16) for a in (k, v)]
    got = paged_attention_cpu.paged_attention_cpu(q, *bits, *rest, **kwargs)
    np.testing.assert_array_equal(
        np.asarray(got, np.float32),
        np.asarray(paged_attention_cpu.paged_attention_cpu(q, k, v, *rest, **kwargs), np.float32),
    )
    ref = paged_attention_reference(q, *bits, *rest, **kwargs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


def test_kv_kind_rejects_pools_it_cannot_read() -> None:
    assert paged_attention_cpu.kv_kind(jnp.uint16, jnp.bfloat16) == 1
    assert paged_attention_cpu.kv_kind(jnp.uint8, jnp.float32) == 4  # fp8 bits
    for bad in ((jnp.int32, jnp.float32), (jnp.float16, jnp.float16), (jnp.uint16, jnp.float16)):
        with pytest.raises(ValueError, match="pool_dtype="):
            paged_attention_cpu.kv_kind(*bad)


def test_lowers_to_custom_calls_and_no_loop() -> None:
    """A step's attention is two custom calls (short requests, then blocks of longer ones; one
    when no request can be long), and none of the reference's traced loops."""
    args, kwargs = _jnp(*build(CASES["mixed_ps32_g2"]))
    text = jax.jit(paged_attention_cpu.paged_attention_cpu).lower(*args, **kwargs).as_text()
    assert text.count(paged_attention_cpu.TARGET) == 2
    assert "while" not in text
    q, *rest = args
    text = jax.jit(paged_attention_cpu.paged_attention_cpu).lower(q[:4], *rest, **kwargs).as_text()
    assert text.count(paged_attention_cpu.TARGET) == 1
