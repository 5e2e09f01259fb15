"""Every kernel test runs in the bounds-checked interpret mode (`pallas_kernels.bounds_check`):
any in-kernel load/store under a true mask that indexes outside its ref fails the test with the
program id and the index, even where interpret mode would clamp the read and a mask would hide it.
Compiled (GPU) kernels are not instrumented."""

from __future__ import annotations

import pytest

from pallas_kernels.bounds_check import check_bounds


@pytest.fixture(autouse=True)
def _bounds_checked_kernels():
    with check_bounds():
        yield
