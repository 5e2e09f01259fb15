"""Parameters that are not materialised yet: each process later builds only the shards it holds.

A multi-process run (docs/distributed.md) must not read or build the whole model in any one
process. The loaders therefore put a `ParamSource` in each parameter slot instead of an array;
`sharding.place` turns it into a global `jax.Array` for a `NamedSharding`:

* `CheckpointSource`: one tensor of a safetensors file, seen through index maps (our axis i =
  file axis `perm[i]`, our index j = file index `maps[i][j]`). Transposes, the LFM2 conv squeeze,
  GPT-OSS's gate/up de-interleave, KV-head replication and the conv gate permutation are all such
  maps, so a shard's slice is read straight from the file with `safe_open(...).get_slice(name)`
  (contiguous runs only, each block read once per placement) and nothing else is.
* `GeneratedSource`: one leaf of a jitted generator (the built-in random-init model). `place`
  runs the generator once per mesh under `jit(out_shardings=...)`: XLA partitions the (threefry,
  partitionable) random bits, so each device computes only its own shard, and the values are
  those of the eager single-device init.

`READ_STATS` counts, per process, the bytes read from checkpoint files (`checkpoint_bytes`), the
bytes of tensors that had to be read whole (`whole_tensor_bytes`: MXFP4-packed experts) and, per
device, XLA's output and temp (working memory) sizes of the generator programs
(`generated_output_bytes`, `generated_temp_bytes`; summed over placements).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

READ_STATS: dict[str, int] = {
    "checkpoint_bytes": 0,
    "whole_tensor_bytes": 0,
    "generated_output_bytes": 0,
    "generated_temp_bytes": 0,
}


def reset_stats() -> None:
    for k in READ_STATS:
        READ_STATS[k] = 0


class ParamSource:
    """Abstract parameter: `shape`, `dtype`, and index maps composed lazily (`take`)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def take(self, axis: int, index: np.ndarray) -> ParamSource:  # pragma: no cover - abstract
        """The source of `x.take(index, axis)` (index: int array of positions along `axis`)."""
        raise NotImplementedError

    def astype(self, dtype) -> ParamSource:  # pragma: no cover - abstract
        raise NotImplementedError

    # the array operations `hf.weights` applies to checkpoint tensors, expressed as maps
    @property
    def T(self) -> ParamSource:  # noqa: N802 - numpy's name
        if self.ndim != 2:
            raise ValueError(f"lazy transpose needs a 2-D tensor, got shape {self.shape}")
        return self._transposed()

    def __getitem__(self, key) -> ParamSource:
        """Only `x[..., a:b:s]` (a strided slice of the last axis)."""
        if not (
            isinstance(key, tuple) and len(key) == 2 and key[0] is Ellipsis and isinstance(key[1], slice)
        ):
            raise ValueError(f"unsupported lazy index {key!r}: only [..., start:stop:step]")
        return self.take(self.ndim - 1, np.arange(self.shape[-1])[key[1]])

    def _transposed(self) -> ParamSource:  # pragma: no cover - abstract
        raise NotImplementedError


class CheckpointSource(ParamSource):
    """Tensor `name` of safetensors `file` (file shape `file_shape`) seen through index maps."""

    def __init__(
        self,
        file: str,
        name: str,
        file_shape: Sequence[int],
        file_dtype: np.dtype,
        perm: tuple[int, ...] | None = None,
        maps: tuple[np.ndarray, ...] | None = None,
        squeeze: tuple[int, ...] = (),
        dtype: np.dtype | None = None,
    ):
        self.file, self.name = file, name
        self.file_shape = tuple(int(s) for s in file_shape)
        self.squeeze = squeeze  # file axes of size 1 that are not ours
        kept = [a for a in range(len(self.file_shape)) if a not in squeeze]
        self.perm = tuple(kept) if perm is None else perm
        self.maps = maps if maps is not None else tuple(np.arange(self.file_shape[a]) for a in self.perm)
        self.shape = tuple(len(m) for m in self.maps)
        self.file_dtype = np.dtype(file_dtype)
        self.dtype = np.dtype(dtype) if dtype is not None else self.file_dtype

    def _with(
        self,
        *,
        perm: tuple[int, ...] | None = None,
        maps: tuple[np.ndarray, ...] | None = None,
        squeeze: tuple[int, ...] | None = None,
        dtype: np.dtype | None = None,
    ) -> CheckpointSource:
        return CheckpointSource(
            self.file,
            self.name,
            self.file_shape,
            self.file_dtype,
            perm=self.perm if perm is None else perm,
            maps=self.maps if maps is None else maps,
            squeeze=self.squeeze if squeeze is None else squeeze,
            dtype=self.dtype if dtype is None else dtype,
        )

    def take(self, axis: int, index: np.ndarray) -> CheckpointSource:
        maps = list(self.maps)
        maps[axis] = maps[axis][np.asarray(index)]
        return self._with(maps=tuple(maps))

    def astype(self, dtype) -> CheckpointSource:
        return self._with(dtype=jnp.dtype(dtype))

    def _transposed(self) -> CheckpointSource:
        return self._with(perm=self.perm[::-1], maps=self.maps[::-1])

    def reshape(self, *shape) -> CheckpointSource:
        """Only dropping size-1 file axes (LFM2 conv `[H, 1, K]` -> `[H, K]`)."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        ones = tuple(a for a in self.perm if self.file_shape[a] == 1 and len(self.perm) > len(shape))
        if self.maps and any(len(m) != self.file_shape[a] for a, m in zip(self.perm, self.maps)):
            raise ValueError("lazy reshape of an already indexed tensor")
        kept = tuple(a for a in self.perm if a not in ones)
        want = tuple(self.file_shape[a] for a in kept)
        if len(shape) != len(want) or any(s not in (-1, w) for s, w in zip(shape, want)):
            raise ValueError(f"unsupported lazy reshape {self.shape} -> {shape}")
        return self._with(
            perm=kept, maps=tuple(np.arange(self.file_shape[a]) for a in kept), squeeze=self.squeeze + ones
        )

    def read(self, index: tuple[slice, ...], cache: dict | None = None) -> np.ndarray:
        """Our slice `index` (basic slices, one per axis) as a host array of `dtype`: the file is
        read in contiguous runs (gaps of one element merged, e.g. de-interleaved gate/up)."""
        need = [m[i] for m, i in zip(self.maps, index)]
        file_need: list[np.ndarray] = [np.zeros(1, np.int64)] * len(self.file_shape)
        for ax, n in zip(self.perm, need):
            file_need[ax] = np.unique(n)
        runs = [_runs(u) for u in file_need]
        block = np.empty([len(u) for u in file_need], self.file_dtype)
        from safetensors import safe_open

        with safe_open(self.file, framework="numpy") as f:
            sl = f.get_slice(self.name)
            for combo in itertools.product(*runs):
                key = tuple((int(a), int(b)) for a, b in combo)  # slices hash only from 3.12
                part = None if cache is None else cache.get((self.name, key))
                if part is None:
                    part = np.asarray(sl[tuple(slice(a, b) for a, b in key)])
                    READ_STATS["checkpoint_bytes"] += part.nbytes
                    if cache is not None:
                        cache[(self.name, key)] = part
                # the needed file indices inside this run -> their positions in `block`
                ranges = [np.arange(a, b) for a, b in combo]
                masks = [np.isin(r, u) for r, u in zip(ranges, file_need)]
                pos = [np.searchsorted(u, r[m]) for u, r, m in zip(file_need, ranges, masks)]
                block[np.ix_(*pos)] = part[np.ix_(*masks)]
        # file order -> ours: select the needed positions, drop squeezed axes, permute
        sel = [np.searchsorted(file_need[ax], n) for ax, n in zip(self.perm, need)]
        full_sel = [np.zeros(1, np.int64)] * len(self.file_shape)
        for ax, s in zip(self.perm, sel):
            full_sel[ax] = s
        out = block[np.ix_(*full_sel)]
        out = out.reshape([out.shape[a] for a in range(out.ndim) if a not in self.squeeze])
        kept = [a for a in range(len(self.file_shape)) if a not in self.squeeze]
        out = out.transpose([kept.index(a) for a in self.perm])
        return out.astype(self.dtype)


def _runs(sorted_idx: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) runs covering `sorted_idx`, merging gaps of one element (stride-2 reads)."""
    runs: list[list[int]] = []
    for i in sorted_idx.tolist():
        if runs and i - runs[-1][1] <= 1:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(a, b) for a, b in runs]


class GeneratedSource(ParamSource):
    """Leaf `key` of `generator()` (a dict of arrays, jit-traceable), with lazy `take`s."""

    def __init__(
        self,
        generator: Callable[[], dict],
        key,
        shape: Sequence[int],
        dtype,
        takes: tuple[tuple[int, np.ndarray], ...] = (),
    ):
        self.generator, self.key, self.takes = generator, key, takes
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)

    def take(self, axis: int, index: np.ndarray) -> GeneratedSource:
        shape = list(self.shape)
        shape[axis] = len(index)
        return GeneratedSource(
            self.generator, self.key, shape, self.dtype, self.takes + ((axis, np.asarray(index)),)
        )

    def astype(self, dtype) -> GeneratedSource:
        raise ValueError("generated parameters are created in their dtype")

    def _transposed(self) -> GeneratedSource:
        raise ValueError("generated parameters are not transposed")

    def value(self, generated: dict) -> jax.Array:
        x = generated[self.key]
        for axis, index in self.takes:
            x = jnp.take(x, jnp.asarray(index), axis=axis)
        return x


def materialize_checkpoint(src: CheckpointSource, sharding) -> jax.Array:
    """The global array of `src` under `sharding`: each local device gets its slice, read from
    the file once per distinct slice (replicated slices are read once per process)."""
    index_map = sharding.addressable_devices_indices_map(src.shape)
    cache: dict = {}
    slices: dict = {}
    arrays = []
    for device, index in index_map.items():
        key = tuple((s.start, s.stop) for s in index)
        if key not in slices:
            slices[key] = src.read(index, cache)
        arrays.append(jax.device_put(slices[key], device))
    out: jax.Array = jax.make_array_from_single_device_arrays(src.shape, sharding, arrays)
    return out


def materialize_generated(leaves: list[tuple[GeneratedSource, object]]) -> list[jax.Array]:
    """Arrays of `GeneratedSource`s sharing one generator: one jitted program, its outputs laid
    out by their shardings (XLA computes each device's shards only)."""
    gen = leaves[0][0].generator

    def program():
        out = gen()
        return [src.value(out) for src, _ in leaves]

    fn = jax.jit(program, out_shardings=[sh for _, sh in leaves])
    compiled = fn.lower().compile()
    mem = compiled.memory_analysis()
    if mem is not None:
        READ_STATS["generated_output_bytes"] += int(mem.output_size_in_bytes)
        READ_STATS["generated_temp_bytes"] += int(mem.temp_size_in_bytes)
    arrays: list[jax.Array] = compiled()
    return arrays


def place_sources(leaves: list, shardings: list) -> list:
    """`leaves` with every ParamSource replaced by its global array (other leaves unchanged)."""
    out = list(leaves)
    groups: dict[int, list[int]] = {}
    for i, (x, sh) in enumerate(zip(leaves, shardings)):
        if isinstance(x, CheckpointSource):
            out[i] = materialize_checkpoint(x, sh)
        elif isinstance(x, GeneratedSource):
            groups.setdefault(id(x.generator), []).append(i)
    for idx in groups.values():
        arrays = materialize_generated([(leaves[i], shardings[i]) for i in idx])
        for i, a in zip(idx, arrays):
            out[i] = a
    return out


def generated_model(build: Callable[[], object]):
    """The nnx module `build()` returns, with every `nnx.Param` a `GeneratedSource` of one shared
    jitted `build` (so nothing model-sized is created here) and its other variables (RoPE
    tables) computed. `build` must be deterministic (a fixed seed)."""
    from flax import nnx

    abstract = nnx.eval_shape(build)
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]  # nnx stubs: variadic
    flat = list(nnx.to_flat_state(params))

    def generator() -> dict:
        return {
            path: var.get_value() for path, var in nnx.to_flat_state(nnx.split(build(), nnx.Param, ...)[1])
        }

    params = nnx.from_flat_state(
        [
            (
                path,
                var.replace(GeneratedSource(generator, path, var.get_value().shape, var.get_value().dtype)),
            )
            for path, var in flat
        ]
    )
    if list(nnx.to_flat_state(rest)):
        rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2])()  # type: ignore[misc]  # nnx stubs: variadic
    return nnx.merge(graphdef, params, rest)
