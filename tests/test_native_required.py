"""`tests.native_kernels.need_native`: a native kernel that does not build fails the test under
`$TOKENSPEED_JAX_REQUIRE_NATIVE` (CI) and skips without it, with the build error either way; a
built kernel passes the gate. The build is faked (no compiler is needed to run these)."""

from __future__ import annotations

import pytest

from pallas_kernels import native
from tests.native_kernels import REQUIRE_NATIVE_ENV, need_native

ERROR = "cc1plus: fatal error: out of cheese"
FAILED, SKIPPED = pytest.fail.Exception, pytest.skip.Exception


def _outcome(name: str) -> tuple[type | None, str]:
    """What `need_native(name)` did to the test: (FAILED or SKIPPED, its message), or (None, "")
    when it let the test go on. Caught here, so a gate that skips where it should fail (or the
    reverse) fails these tests instead of turning them into skips."""
    try:
        need_native(name)
    except (FAILED, SKIPPED) as e:
        return type(e), str(e)
    return None, ""


@pytest.fixture
def broken_build(monkeypatch) -> None:
    """Every native kernel fails to build in this test, with ERROR (fresh load state, so a kernel
    this process already loaded is built again)."""

    def fail(name: str) -> str:
        raise RuntimeError(ERROR)

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why", {})
    monkeypatch.setattr(native, "_build", fail)


@pytest.mark.parametrize("name", ["paged_attention", "block_matmul"])
def test_required_and_broken_fails_with_the_build_error(broken_build, monkeypatch, name) -> None:
    monkeypatch.setenv(REQUIRE_NATIVE_ENV, "1")
    kind, message = _outcome(name)
    assert kind is FAILED, (kind, message)
    assert name in message and REQUIRE_NATIVE_ENV in message and ERROR in message


@pytest.mark.parametrize("value", [None, "", "0"])
def test_not_required_and_broken_skips_with_the_build_error(broken_build, monkeypatch, value) -> None:
    if value is None:
        monkeypatch.delenv(REQUIRE_NATIVE_ENV, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_NATIVE_ENV, value)
    kind, message = _outcome("paged_attention")
    assert kind is SKIPPED, (kind, message)
    assert "paged_attention" in message and ERROR in message


@pytest.mark.parametrize("value", [None, "1"])
def test_a_built_kernel_passes_the_gate(monkeypatch, value) -> None:
    def never(name: str) -> str:
        raise AssertionError("a loaded kernel is not built again")

    # a loaded library stands in for a successful build (no compiler needed here)
    monkeypatch.setattr(native, "_loaded", {"block_matmul": object()})
    monkeypatch.setattr(native, "_build", never)
    if value is None:
        monkeypatch.delenv(REQUIRE_NATIVE_ENV, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_NATIVE_ENV, value)
    assert _outcome("block_matmul") == (None, "")  # neither fails nor skips
