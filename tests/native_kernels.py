"""`need_native(name)`: the one gate of every test that needs a native (C++) CPU kernel.

A kernel that does not build falls back to the jnp reference at run time, which is right for a
user without a compiler but wrong for CI: its tests used to skip ("no C++ compiler here"), so a
kernel broken by an edit turned into green skips. With `TOKENSPEED_JAX_REQUIRE_NATIVE=1` (which
`.ci/run` exports) such a test fails with the build error instead; without it, it skips with
that error as the reason.
"""

from __future__ import annotations

import os

import pytest

from pallas_kernels import native

REQUIRE_NATIVE_ENV = "TOKENSPEED_JAX_REQUIRE_NATIVE"


def native_required() -> bool:
    """Whether a native kernel that does not build fails the test (anything but unset, "" or
    "0" in `$TOKENSPEED_JAX_REQUIRE_NATIVE`)."""
    return os.environ.get(REQUIRE_NATIVE_ENV, "0") not in ("", "0")


def need_native(name: str) -> None:
    """Return when native kernel `name` (a `pallas_kernels.native` kernel: "paged_attention",
    "block_matmul") is built and registered in this process (building it once); otherwise fail
    the calling test when `native_required()`, else skip it, with the build error either way."""
    if native.load(name) is not None:
        return
    why = native.unavailable(name) or "not built (no reason recorded)"
    if native_required():
        pytest.fail(
            f"native kernel {name!r} did not build and ${REQUIRE_NATIVE_ENV} requires it: {why}",
            pytrace=False,
        )
    pytest.skip(f"native kernel {name!r} unavailable here: {why}")
