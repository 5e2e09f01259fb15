"""`LayerSlice`: layer `index` of a stacked weight `stacked[L, ...]`, which a native CPU kernel
reads in place.

Under scan over layers (`tokenspeed_jax.models.layer_scan`) each layer's weights are a slice of
arrays stacked over the layers. XLA:CPU materializes a `dynamic-slice` as a copy before the
custom call that consumes it, so a weight-bound decode step would read every weight three times
(copy in, copy out, product). A `LayerSlice` passes the whole stack and the index instead, and
the native matmul (`block_matmul_cpu`) offsets its pointer: no copy. Every other consumer asks
for the slice itself (`materialize`), which XLA copies as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """stacked[index] without the copy: stacked [L, ...], index i32[] (traced: a scan's counter).

    Looks like the slice where code only inspects it (`shape`, `dtype`, `ndim`, `x[...]`);
    anything else goes through `materialize`."""

    stacked: jax.Array
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stacked.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.stacked.dtype

    @property
    def ndim(self) -> int:
        return self.stacked.ndim - 1

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __getitem__(self, key: Any) -> Any:
        # `param[...]` (nnx) keeps the slice; any real indexing reads it
        return self if key is Ellipsis else materialize(self)[key]

    def astype(self, dtype: Any) -> Any:
        return self if jax.numpy.dtype(dtype) == self.dtype else materialize(self).astype(dtype)


# a weight operand as the native kernels take it: an array, or a layer of a stack read in place
Weight = jax.Array | LayerSlice


def whole(a: Weight | None) -> jax.Array | None:
    """What goes to the kernel for `a`: the whole stack of a `LayerSlice`, else a itself."""
    return a.stacked if isinstance(a, LayerSlice) else a


def materialize(a: Any) -> Any:
    """a's value as an array: `stacked[index]` for a `LayerSlice` (a copy on XLA:CPU), else a."""
    if isinstance(a, LayerSlice):
        return jax.lax.dynamic_index_in_dim(a.stacked, a.index, axis=0, keepdims=False)
    return a
