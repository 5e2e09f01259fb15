"""Scan over layers: trace one decoder layer per run of identical layers, not every layer.

A *run* is a maximal stretch of consecutive layers with the same static structure (their nnx
graphdefs are equal: layer type, window, RoPE, norms, MoE) in the same cache group. A run's
parameters are stacked on a leading axis, and so are its page pools; `jax.lax.scan` applies it,
so XLA compiles one layer body per run instead of one per layer. Llama / Qwen3 / SmolLM2 are one
run; Gemma 3 (5 sliding : 1 full) and LFM2 (conv and attention interleaved) are several.

Pools: a run of n layers holds each pool as one array f[n, P, B, ...]. Inside the scan it is seen
as f[n*P, B, ...] and layer i addresses its own slice by offsetting page ids by i*P: page tables
+ i*P (a hole, page 0, becomes layer i's own null page, zero like every null page) and write
indices + i*P*B (the drop sentinel moves to n*P*B). So the layer code and the kernels are
unchanged, and the K/V scatter updates the scan carry in place: no per-layer copy of a pool.

Parameters are `{"shell": nnx.State of the model without its layers, "runs": (stacked nnx.State
of each run's layers, ...)}`; the static half is a `ScannedGraph`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.stacked import LayerSlice
from tokenspeed_jax.models.batch import PagedBatch
from tokenspeed_jax.models.decoder import AttnFn, CausalLM


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Layers [start, stop) of cache group `group`, applied by one scan."""

    start: int
    stop: int
    group: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def layer_runs(model: CausalLM, layer_groups: tuple[int, ...]) -> tuple[LayerRun, ...]:
    """The maximal runs of consecutive layers with equal graphdefs and the same cache group."""
    defs = [nnx.graphdef(layer) for layer in model.layers]
    runs, start = [], 0
    for i in range(1, len(defs) + 1):
        if i == len(defs) or defs[i] != defs[start] or layer_groups[i] != layer_groups[start]:
            runs.append(LayerRun(start, i, layer_groups[start]))
            start = i
    return tuple(runs)


def stack_trees(trees: list[Any]) -> Any:
    """Leaf-wise `jnp.stack` of equally structured pytrees (a run's layer states)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def run_cache_shapes(
    layer_shapes: list[dict[str, tuple[int, ...]]], runs: tuple[LayerRun, ...]
) -> list[dict[str, tuple[int, ...]]]:
    """Per-run pool shapes: each layer pool shape with the run length in front."""
    return [{k: (r.size, *s) for k, s in layer_shapes[r.start].items()} for r in runs]


def _layer_batch(
    batch: PagedBatch, group: int, i: jax.Array, num_pages: int, page_size: int, n: int
) -> PagedBatch:
    """`batch` with group `group`'s page ids moved to layer i's slice of an n-layer pool."""
    tables, writes = list(batch.page_tables), list(batch.write_idx)
    tables[group] = tables[group] + i * num_pages
    w = writes[group]
    per_layer = num_pages * page_size
    writes[group] = jnp.where(w < per_layer, w + i * per_layer, n * per_layer)
    reads, states = list(batch.state_read), list(batch.state_write)
    reads[group] = reads[group] + i * num_pages
    s = states[group]
    states[group] = jnp.where(s < num_pages, s + i * num_pages, n * num_pages)
    return dataclasses.replace(
        batch,
        page_tables=tuple(tables),
        write_idx=tuple(writes),
        state_read=tuple(reads),
        state_write=tuple(states),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class ScannedGraph:
    """The static half of a scanned `CausalLM`: the shell's graphdef (embeddings, final norm,
    lm_head: everything but the layers) and one layer graphdef per run."""

    shell: Any
    layer_defs: tuple[Any, ...]
    runs: tuple[LayerRun, ...]

    @classmethod
    def split(cls, model: CausalLM, layer_groups: tuple[int, ...]) -> tuple[ScannedGraph, dict]:
        """(graph, params): the scanned counterpart of `nnx.split(model)`. The model is left as
        it was; its layer arrays are copied into the stacked ones."""
        runs = layer_runs(model, layer_groups)
        layers = list(model.layers)
        split = [nnx.split(layer) for layer in layers]
        model.layers = nnx.List([])
        try:
            shell_def, shell_state = nnx.split(model)
        finally:
            model.layers = nnx.List(layers)
        stacked = tuple(stack_trees([split[i][1] for i in range(r.start, r.stop)]) for r in runs)
        graph = cls(shell_def, tuple(split[r.start][0] for r in runs), runs)
        return graph, {"shell": shell_state, "runs": stacked}

    def merge_shell(self, params: dict) -> CausalLM:
        """The model without layers (embed / norm / logits), bound to `params["shell"]`."""
        return nnx.merge(self.shell, params["shell"])

    def forward(
        self,
        params: dict,
        token_ids: jax.Array,
        caches: tuple[dict, ...],
        batch: PagedBatch,
        attn_fn: AttnFn,
        conv_fn: Callable | None = None,
    ) -> tuple[jax.Array, tuple[dict, ...], CausalLM]:
        """`CausalLM.__call__` over stacked runs: i32[T] -> (final-normed hidden f[T, H], new
        per-run caches {name: f[n, P, B, ...]}, the shell model for the logits)."""
        shell = self.merge_shell(params)
        x = shell.embed(token_ids)
        new_caches = []
        for run, layer_def, run_params, cache in zip(
            self.runs, self.layer_defs, params["runs"], caches, strict=True
        ):
            x, c = self._scan_run(run, layer_def, run_params, cache, x, batch, attn_fn, conv_fn)
            new_caches.append(c)
        return shell.norm(x), tuple(new_caches), shell

    @staticmethod
    def _scan_run(
        run: LayerRun,
        layer_def: Any,
        run_params: Any,
        cache: dict,
        x: jax.Array,
        batch: PagedBatch,
        attn_fn: AttnFn,
        conv_fn: Callable | None,
    ) -> tuple[jax.Array, dict]:
        # the group's page size from the batch: a state pool's third axis is no page (and dict
        # order is not the pools' order once they went through a pytree)
        n, num_pages = next(iter(cache.values())).shape[:2]
        page_size = batch.page_sizes[run.group]
        flat = {k: v.reshape(n * num_pages, *v.shape[2:]) for k, v in cache.items()}

        # Linear weights go in whole, as LayerSlices the native matmul reads in place; the
        # rest (norms, biases: small) is sliced by the scan as usual
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(run_params)
        in_place = [_read_in_place(path) for path, _ in paths_leaves]
        whole = [leaf for (_, leaf), keep in zip(paths_leaves, in_place, strict=True) if keep]
        sliced = [leaf for (_, leaf), keep in zip(paths_leaves, in_place, strict=True) if not keep]

        def body(carry, xs):
            h, pools = carry
            i, layer_sliced = xs
            whole_it, sliced_it = iter(whole), iter(layer_sliced)
            leaves = [LayerSlice(next(whole_it), i) if keep else next(sliced_it) for keep in in_place]
            layer = nnx.merge(layer_def, jax.tree_util.tree_unflatten(treedef, leaves))
            lb = _layer_batch(batch, run.group, i, num_pages, page_size, n)
            h, pools = layer.paged(h, pools, lb, run.group, attn_fn, conv_fn)
            return (h, pools), None

        (x, flat), _ = jax.lax.scan(body, (x, flat), (jnp.arange(n, dtype=jnp.int32), sliced))
        return x, {k: flat[k].reshape(cache[k].shape) for k in cache}


# a Linear's weights (models.layers.Linear: kernel, kernel_scale, kernel_min); every consumer
# either reads a LayerSlice in place (native CPU matmul) or materializes it (pallas_kernels.stacked)
_IN_PLACE = ("kernel", "kernel_scale", "kernel_min")


def _read_in_place(path: tuple) -> bool:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names = [n for n in names if n != "value"]  # nnx.Variable's own level
    return bool(names) and names[-1] in _IN_PLACE
