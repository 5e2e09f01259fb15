"""The one place that knows which Pallas GPU lowering we target and how its API is spelled.

Kernels in this package are written against the small surface below (`load`, `store`, `dot`,
`compiler_params`, `pallas_call`) instead of calling `jax.experimental.pallas.triton` directly,
because that API moved between jax releases:

- jax <= 0.4.3x: `pl.load(ref, idx, mask=, other=)`, `pl.dot`, `plgpu.TritonCompilerParams`
  (or a `{"triton": {...}}` dict);
- jax 0.6 - 0.12: `plgpu.load(ref.at[idx], mask=, other=)`, `plgpu.CompilerParams`; `pl.dot` /
  `plgpu.dot` come and go (we use `lax.dot_general`, which they wrap).

Only the Triton lowering is implemented today (`BACKEND == "triton"`). A Mosaic GPU variant would
add a second branch here (its kernels need warpgroup-level code, so it would also get its own
kernel bodies); callers only ever see `compiler_params(...)` and the load/store helpers.
Everything here also works with `interpret=True` on CPU, where compiler params are ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import bounds_check

try:  # jax >= 0.4.31 ships the Triton-specific namespace.
    from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - very old jax
    _plgpu = None

BACKEND = "triton"

# jax >= 0.6: load/store take a (possibly `.at[...]`-indexed) ref and no separate index.
_REF_ONLY_LOAD = _plgpu is not None and hasattr(_plgpu, "load")


def _indexed(ref: Any, idx: Sequence[Any]) -> Any:
    return ref.at[tuple(idx)]


def load(ref: Any, idx: Sequence[Any], *, mask: jax.Array | None = None, other: Any = None
         ) -> jax.Array:
    """Gather `ref[idx]` where `mask`, else `other`; masked lanes are never dereferenced on GPU.

    `idx` entries are scalars or int arrays that broadcast together (no slices: interpret mode
    only discharges all-array indexers), so every load in our kernels is an explicit gather.
    """
    bounds_check.check_access("load", ref, idx, mask)  # no-op outside the test-only mode
    if _REF_ONLY_LOAD:
        return _plgpu.load(_indexed(ref, idx), mask=mask, other=other)
    return pl.load(ref, tuple(idx), mask=mask, other=other)  # pragma: no cover - old jax


def store(ref: Any, idx: Sequence[Any], val: jax.Array, *, mask: jax.Array | None = None
          ) -> None:
    """Scatter `val` into `ref[idx]` where `mask`.

    Masked lanes must point at an out-of-range index (or be unique): in interpret mode a masked
    lane writes back the old value, and a duplicate index could race with a real write.
    """
    bounds_check.check_access("store", ref, idx, mask)
    if _REF_ONLY_LOAD:
        _plgpu.store(_indexed(ref, idx), val, mask=mask)
        return
    pl.store(ref, tuple(idx), val, mask=mask)  # pragma: no cover - old jax


def dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """2-D matmul `a @ b` (or `a @ b.T`) with float32 accumulation.

    Written as `lax.dot_general` (what `pl.dot` / `plgpu.dot` expand to) because the wrappers
    moved or vanished across releases while dot_general lowers everywhere. bf16 inputs hit
    tensor cores; float32 inputs ask for HIGHEST precision, which the Triton lowering maps to
    IEEE (not TF32), so float32 results match the reference closely.
    """
    precision = (lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype)
                 else lax.Precision.DEFAULT)
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def compiler_params(*, num_warps: int, num_stages: int) -> Any:
    """Backend compiler parameters, whatever this jax release calls their class."""
    for name in ("CompilerParams", "TritonCompilerParams"):
        cls = getattr(_plgpu, name, None)
        if cls is not None:
            return cls(num_warps=num_warps, num_stages=num_stages)
    return {"triton": {"num_warps": num_warps, "num_stages": num_stages}}  # pragma: no cover


def pallas_call(kernel: Callable[..., None], *, out_shape: Any, grid: tuple[int, ...],
                num_warps: int, num_stages: int, interpret: bool, name: str,
                input_output_aliases: dict[int, int] | None = None) -> Callable[..., Any]:
    """`pl.pallas_call` with whole-array refs (no BlockSpecs: our kernels index pages themselves
    through the page table, so blocking by the grid would not help) and backend params."""
    if interpret and bounds_check.active():
        body = kernel

        def kernel(*refs: Any) -> None:  # the checks report the program id of each access
            with bounds_check.program_ids(len(grid)):
                body(*refs)

    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=input_output_aliases or {},
        compiler_params=compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )


def is_power_of_2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
