"""Generic packing of one step's device inputs into ONE int32 buffer (and back, inside jit).

The leader broadcasts a step as one flat buffer, and every process feeds the step one flat
device array (one host->device copy instead of ~20), unpacked inside the jitted step with
static slices. The packing is generic over a pytree of 4-byte / bool numpy arrays: the *layout*
(treedef + per-leaf name, shape, dtype, offset) is a pure function of the shapes, which depend
only on the scheduler config and the token bucket, so leader and followers derive identical
layouts from `Scheduler.padding_ops()` without exchanging them.

`host_inputs(ops, bucket)` picks what the runner's jitted step reads from a `StepOps` (the same
fields as `ModelRunner._device_ops`); it would become the StepOps schema once StepOps itself is
schema-driven (issue 11), and `pack` / `unpack` do not care which fields they carry.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.runner import _GROUP_FIELDS, _ROW_FIELDS, _TOKEN_FIELDS

_BITCAST = (np.dtype(np.float32), np.dtype(np.uint32))  # carried bit for bit in an int32 word
_INT = (np.dtype(np.int32),)


@dataclasses.dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    dtype: str
    offset: int  # in int32 words

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static description of a packed pytree (hashable: usable as a jit cache key)."""

    treedef: jax.tree_util.PyTreeDef
    leaves: tuple[Leaf, ...]

    @property
    def size(self) -> int:
        return sum(leaf.size for leaf in self.leaves)


def host_inputs(ops, bucket: int, *, with_rows: bool = False) -> dict:
    """The numpy inputs of one step: token fields cut to `bucket`, row fields, and per group
    every field except the i32[R, W_g] refresh `rows` unless `with_rows` (they travel apart, and
    only on steps that carry a full refresh)."""
    d = {k: np.asarray(getattr(ops, k))[:bucket] for k in _TOKEN_FIELDS}
    d.update({k: np.asarray(getattr(ops, k)) for k in _ROW_FIELDS})
    fields = _GROUP_FIELDS if with_rows else tuple(k for k in _GROUP_FIELDS if k != "rows")
    d["groups"] = [{k: np.asarray(getattr(g, k)) for k in fields} for g in ops.groups]
    return d


def layout_of(tree) -> Layout:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out, offset = [], 0
    for x in leaves:
        x = np.asarray(x)
        if x.dtype != np.bool_ and x.dtype not in _BITCAST + _INT:
            raise TypeError(f"cannot pack dtype {x.dtype} (int32, uint32, float32, bool only)")
        out.append(Leaf(tuple(x.shape), x.dtype.str, offset))
        offset += x.size
    return Layout(treedef, tuple(out))


def pack(tree, layout: Layout) -> np.ndarray:
    """int32[layout.size]: every leaf flattened, bools as 0/1, float32 / uint32 bit-cast."""
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) != len(layout.leaves):
        raise ValueError(f"tree has {len(leaves)} leaves, layout {len(layout.leaves)}")
    out = np.empty(layout.size, np.int32)
    for x, leaf in zip(leaves, layout.leaves, strict=True):
        x = np.asarray(x)
        if x.shape != leaf.shape or x.dtype.str != leaf.dtype:
            raise ValueError(f"leaf {x.dtype}{list(x.shape)} does not match layout "
                             f"{leaf.dtype}{list(leaf.shape)}")
        flat = x.reshape(-1)
        if x.dtype in _BITCAST:
            flat = flat.view(np.int32)
        out[leaf.offset:leaf.offset + leaf.size] = flat
    return out


def unpack(buf: jax.Array, layout: Layout):
    """Inverse of `pack` inside jit: static slices of the int32 buffer, reshaped and cast."""
    leaves = []
    for leaf in layout.leaves:
        x = jax.lax.slice(buf, (leaf.offset,), (leaf.offset + leaf.size,)).reshape(leaf.shape)
        dtype = np.dtype(leaf.dtype)
        if dtype == np.bool_:
            x = x != 0
        elif dtype in _BITCAST:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        leaves.append(x)
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


def unpack_host(buf: np.ndarray, layout: Layout):
    """numpy twin of `unpack` (tests and debugging)."""
    leaves = []
    for leaf in layout.leaves:
        x = buf[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape)
        dtype = np.dtype(leaf.dtype)
        leaves.append(x != 0 if dtype == np.bool_ else x.view(dtype) if dtype in _BITCAST else x)
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)
