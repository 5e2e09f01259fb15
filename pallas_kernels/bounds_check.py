"""Test-only bounds-checked interpret mode for the Pallas kernels.

On a GPU, a masked-on lane whose index lies outside its ref is an illegal memory access (or a
silent read of a neighbouring buffer). Pallas interpret mode hides it: out-of-range gathers are
clamped and out-of-range scatters dropped, so a kernel that reads garbage a later `jnp.where`
throws away still passes every CPU test. Under `check_bounds()`, every `backend.load` /
`backend.store` issued while tracing a kernel also checks, lane by lane, that each index
component of every lane whose mask is true lies in `[0, dim)` of the ref's shape, and reports the
first offending lane per access with the program id, the index and the Python line that issued it:

    with check_bounds():
        out = paged_attention(..., interpret=True)   # raises IndexError on any violation

The check is traced into the kernel (a few vector ops plus one host callback per access), so it
only applies to calls traced inside the `with` block, and only to kernels run with
`interpret=True` (compiled GPU kernels are left untouched: they cannot call back into Python).
`tests/pallas_kernels/conftest.py` runs every kernel test inside `check_bounds()`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["BoundsViolation", "active", "check_access", "check_bounds", "program_ids"]

_state = threading.local()


class BoundsViolation(IndexError):
    """An in-kernel load/store under a true mask indexed outside its ref."""


def active() -> bool:
    """True inside `check_bounds()` (kernels traced now get the checks if interpreted)."""
    return getattr(_state, "violations", None) is not None


@contextlib.contextmanager
def program_ids(rank: int) -> Iterator[None]:
    """Entered by `backend.pallas_call` at the top of an INTERPRETED kernel body while it is
    traced (only there do the checks apply: a compiled kernel cannot call back to Python). Reads
    the program ids once (interpret mode only substitutes `program_id` at the kernel's top level,
    not inside loop bodies, where most accesses are)."""
    old = getattr(_state, "pids", None)
    _state.pids = jnp.stack([pl.program_id(a) for a in range(rank)] or [jnp.int32(-1)])
    try:
        yield
    finally:
        _state.pids = old


@contextlib.contextmanager
def check_bounds() -> Iterator[list[str]]:
    """Check every kernel load/store traced inside the block; raise `BoundsViolation` at exit
    if any access went out of range. Yields the (live) list of violation messages."""
    outer = getattr(_state, "violations", None)
    violations: list[str] = []
    _state.violations = violations  # nested blocks report their own accesses
    try:
        yield violations
        jax.effects_barrier()  # callbacks run asynchronously; wait for all of them
    finally:
        _state.violations = outer
    if violations:
        shown = "\n  ".join(violations[:10])
        more = f"\n  ... and {len(violations) - 10} more" if len(violations) > 10 else ""
        raise BoundsViolation(f"{len(violations)} out-of-bounds kernel access(es):\n  {shown}{more}")


def check_access(kind: str, ref: Any, idx: Sequence[Any], mask: jax.Array | None) -> None:
    """Trace the bounds check of one access `ref[idx]` (lanes where `mask`) into the kernel;
    a no-op unless inside `check_bounds()` and an interpreted kernel."""
    if not active() or getattr(_state, "pids", None) is None:
        return
    shape = tuple(ref.shape)
    comps = [jnp.asarray(i, jnp.int32) for i in idx]
    lanes = jnp.broadcast_shapes(*(c.shape for c in comps), *(() if mask is None else (jnp.shape(mask),)))
    comps = [jnp.broadcast_to(c, lanes).reshape(-1) for c in comps]
    on = (
        jnp.ones(lanes, jnp.bool_) if mask is None else jnp.broadcast_to(jnp.asarray(mask, jnp.bool_), lanes)
    ).reshape(-1)
    out = jnp.zeros_like(on)
    for c, dim in zip(comps, shape, strict=False):
        out = out | (c < 0) | (c >= dim)
    if len(comps) > len(shape):  # more index components than dims: always a bug
        out = jnp.ones_like(on)
    bad = on & out
    first = jnp.argmax(bad)
    where = jnp.stack([c[first] for c in comps])
    pids = _state.pids
    caller = sys._getframe(2)  # the kernel line that called backend.load/store
    site = f"{caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}"
    sink = _state.violations

    def report(any_bad: jax.Array, n_bad: jax.Array, pid: jax.Array, index: jax.Array) -> None:
        if bool(any_bad):
            sink.append(
                f"{site} {kind} of ref{list(shape)} at program_id={pid.tolist()}: "
                f"index {index.tolist()} out of range ({int(n_bad)} lane(s) bad)"
            )

    jax.debug.callback(report, jnp.any(bad), jnp.sum(bad), pids, where)
