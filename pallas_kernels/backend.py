"""The one place that knows which Pallas GPU lowering we target and how its API is spelled.

Kernels in this package are written against the small surface below (`load`, `store`, `dot`,
`compiler_params`, `pallas_call`) instead of calling `jax.experimental.pallas.triton` directly,
because that API moved between jax releases (jax <= 0.4.3x had `pl.load(ref, idx, ...)` and
`plgpu.TritonCompilerParams`; the jax >= 0.10 this project requires has
`plgpu.load(ref.at[idx], mask=, other=)` and `plgpu.CompilerParams`; `pl.dot` / `plgpu.dot` come
and go, so we use `lax.dot_general`, which they wrap). A jax release that moves it again needs
only this module changed.

Only the Triton lowering is implemented today (`BACKEND == "triton"`). A Mosaic GPU variant would
add a second branch here (its kernels need warpgroup-level code, so it would also get its own
kernel bodies); callers only ever see `compiler_params(...)` and the load/store helpers.
Everything here also works with `interpret=True` on CPU, where compiler params are ignored.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import bounds_check

BACKEND = "triton"

# A kernel's view of one operand (a Pallas ref): jax exports no public type for it.
Ref: TypeAlias = Any


def load(ref: Ref, idx: Sequence[Any], *, mask: jax.Array | None = None, other: Any = None) -> jax.Array:
    """Gather `ref[idx]` where `mask`, else `other`; masked lanes are never dereferenced on GPU.

    `idx` entries are scalars or int arrays that broadcast together (no slices: interpret mode
    only discharges all-array indexers), so every load in our kernels is an explicit gather.
    """
    bounds_check.check_access("load", ref, idx, mask)  # no-op outside the test-only mode
    out: jax.Array = plgpu.load(ref.at[tuple(idx)], mask=mask, other=other)
    return out


def store(ref: Ref, idx: Sequence[Any], val: jax.Array, *, mask: jax.Array | None = None) -> None:
    """Scatter `val` into `ref[idx]` where `mask`.

    Masked lanes must point at an out-of-range index (or be unique): in interpret mode a masked
    lane writes back the old value, and a duplicate index could race with a real write.
    """
    bounds_check.check_access("store", ref, idx, mask)
    plgpu.store(ref.at[tuple(idx)], val, mask=mask)


def dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """2-D matmul `a @ b` (or `a @ b.T`) with float32 accumulation.

    Written as `lax.dot_general` (what `pl.dot` / `plgpu.dot` expand to) because the wrappers
    moved or vanished across releases while dot_general lowers everywhere. bf16 inputs hit
    tensor cores; float32 inputs ask for HIGHEST precision, which the Triton lowering maps to
    IEEE (not TF32), so float32 results match the reference closely.
    """
    precision = lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else lax.Precision.DEFAULT
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def compiler_params(*, num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """The Triton backend's compiler parameters."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: tuple[int, ...],
    num_warps: int,
    num_stages: int,
    interpret: bool,
    name: str,
    input_output_aliases: dict[int, int] | None = None,
) -> Callable[..., Any]:
    """`pl.pallas_call` with whole-array refs (no BlockSpecs: our kernels index pages themselves
    through the page table, so blocking by the grid would not help) and backend params."""
    if interpret and bounds_check.active():
        body = kernel

        def kernel(*refs: Ref) -> None:  # the checks report the program id of each access
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


def check_config(config: Any, *, powers_of_2: Sequence[str]) -> None:
    """ValueError naming the field unless every field of the (dataclass) kernel `config` is an
    int >= 1 and those in `powers_of_2` are powers of two (Triton tile sizes)."""
    name = type(config).__name__
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}.{field.name}={value!r} must be an int >= 1")
    for field_name in powers_of_2:
        if not is_power_of_2(getattr(config, field_name)):
            raise ValueError(f"{name}.{field_name}={getattr(config, field_name)} must be a power of two")


# Which implementation runs one chunk of a recurrence (gated delta, Mamba2 SSD): the jnp form,
# the Pallas kernel (interpret mode off GPU), or "auto": the kernel on a GPU where it fits.
ChunkImpl = Literal["auto", "jnp", "pallas"]
CHUNK_IMPLS: tuple[str, ...] = get_args(ChunkImpl)


def check_chunk_impl(impl: str) -> None:
    if impl not in CHUNK_IMPLS:
        raise ValueError(f"chunk_impl must be one of {CHUNK_IMPLS}, got {impl!r}")


ChunkFn = Callable[..., tuple[jax.Array, jax.Array]]  # one chunk of a recurrence: state, inputs


def pick_chunk(impl: str, supported: bool, jnp_chunk: ChunkFn, kernel: ChunkFn) -> ChunkFn:
    """The one-chunk implementation chunk_impl `impl` runs: the Pallas `kernel` for "pallas"
    (its own shape check raises where it is not `supported`; interpret mode off GPU) and for
    "auto" on a GPU where `supported`, else `jnp_chunk`."""
    on_gpu = jax.default_backend() == "gpu"
    if impl == "pallas" or (impl == "auto" and on_gpu and supported):
        return functools.partial(kernel, interpret=not on_gpu)
    return jnp_chunk


def triton_dims_ok(*dims: int) -> bool:
    """Whether every dimension can be a Triton tile side: a power of two, and >= 16 for its dots."""
    return all(is_power_of_2(d) and d >= 16 for d in dims)


def is_power_of_2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
