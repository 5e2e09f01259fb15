"""New weights for running `ModelRunner`s, through the load path (issue 48).

`WeightLoader.plan(weights)` turns an update (`runtime.weight_inputs`) into the runners' new
parameter leaves:
1. raw parameters `{path: array}` (names, shapes and dtypes checked: ValueError naming the tensor);
2. a raw `CausalLM` assembled from them, exactly as `hf.weights.load_model_from_tensors` does;
3. `runtime.prepare.prepare` with the options the `LLM` was built with: KV-head replication and
   the conv re-layout for tensor parallelism, quantization, native tiling, q / k / v and gate /
   up fusion: the same transforms as at load, by the same code;
4. per runner, the prepared leaves split like at construction (`nnx.split`, or `scan_layers`'
   stacking) and put on the sharding of the leaf they replace (`jax.device_put`: a no-op for an
   array already there, so nothing goes through the host).
Every new leaf must have its old leaf's shape and dtype: the step executables compiled for the
old ones run the new ones (no recompile). `ModelRunner.set_param_leaves` then swaps them in.

Partial updates: only the prepared leaves whose module a named tensor belongs to are replaced;
the others keep their arrays. A replaced module must be named whole: a Linear's kernel with its
bias, and, where the engine fused them (`PreparedModel.fused`), q / k / v together and gate / up
together (their columns live in one prepared tensor). Unnamed parameters are stand-in zeros (one
buffer per shape) while the model is prepared, and their prepared leaves are dropped: a partial
update costs the preparation of the whole model. Under `scan_layers` (layers stacked into one
array per run) a stack whose layers are named only in part is the running stack with those
layers replaced (a new array of the stack's size).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tokenspeed_jax.hf.weights import Path
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.decoder import CausalLM
from tokenspeed_jax.runtime.prepare import prepare
from tokenspeed_jax.runtime.weight_inputs import _keypath_parts, dotted, raw_update

log = logging.getLogger("tokenspeed_jax.weights")
# a fused prepared Linear -> the raw Linear whose place it took (`fuse_projections`)
_FUSED = {"qkv_proj": "q_proj", "gate_up_proj": "gate_proj"}
_ABSORBED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
_TABLE = ("embed_tokens", "embed_scale_q", "embed_min_q")  # a (quantized) tied table's leaves


def prepared_owner(path: Path) -> Path:
    """The raw module a prepared leaf is computed from (fused Linears: their first member)."""
    if len(path) == 1:
        return ("embed_tokens",) if path[0] in _TABLE else path
    module = path[:-1]
    last = module[-1]
    return (*module[:-1], _FUSED[last]) if isinstance(last, str) and last in _FUSED else module


def raw_owner(path: Path, fused: bool) -> Path:
    """The module key of a raw parameter, on the same scale as `prepared_owner`."""
    if len(path) == 1:
        return path
    module = path[:-1]
    last = module[-1]
    if fused and isinstance(last, str) and last in _ABSORBED:
        return (*module[:-1], _ABSORBED[last])
    return module


@dataclasses.dataclass
class WeightPlan:
    """An update ready to swap in: per runner, its new leaves (None: keep the old one)."""

    leaves: list[list[jax.Array | None]]
    num_tensors: int  # raw tensors named
    num_replaced: int  # prepared leaves replaced, summed over the runners
    bytes: int  # of the replaced leaves, summed over the runners


class WeightLoader:
    """How an `LLM` rebuilds its runners' parameters from raw weights.

    model_config: the raw (checkpoint) config, as `hf.sources.load_model` returned it.
    family: the Hugging Face family whose names `hf.weights.map_checkpoint` translates ("" for
        the built-in model: Llama-style names).
    prepare_options: the keyword arguments `runtime.prepare.prepare` got at load.
    jit: prepare in one jitted program (`prepared_model`), else eagerly (op by op, as at load).
    """

    def __init__(
        self, model_config: ModelConfig, family: str, prepare_options: dict[str, Any], *, jit: bool = True
    ) -> None:
        self.model_config = model_config
        self.family = family
        self.prepare_options = dict(prepare_options)
        abstract = nnx.eval_shape(lambda: CausalLM(model_config, rngs=nnx.Rngs(0)))
        # two filters give exactly three parts; nnx.split's annotation types the tail as variadic
        split: Any = nnx.split(abstract, nnx.Param, ...)
        self._graphdef: Any = split[0]
        self._rest: Any = split[2]
        params = split[1]
        self._flat = list(nnx.to_flat_state(params))
        self.targets: dict[Path, tuple[int, ...]] = {p: tuple(v.get_value().shape) for p, v in self._flat}
        self._buffers: Any = None
        self._zeros: dict[tuple, jax.Array] = {}
        self._prepared_info: tuple[Any, bool, Any, dict[int, int]] = (None, False, None, {})
        self._program: Any = jax.jit(self._prepare) if jit else None

    def _buffers_state(self) -> Any:
        """The non-parameter variables (RoPE tables), computed once."""
        if self._buffers is None:
            cfg = self.model_config
            if list(nnx.to_flat_state(self._rest)):
                self._buffers = jax.jit(
                    lambda: nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)[2]  # type: ignore[misc]
                )()
            else:
                self._buffers = self._rest
        return self._buffers

    def _zero(self, shape: tuple[int, ...]) -> jax.Array:
        key = (shape, self.model_config.dtype)
        if key not in self._zeros:
            self._zeros[key] = jnp.zeros(shape, self.model_config.dtype)
        return self._zeros[key]

    def _values(self, values: dict[Path, jax.Array]) -> list[jax.Array]:
        """Every raw parameter in `_flat` order (unnamed ones: stand-in zeros)."""
        return [values[p] if p in values else self._zero(self.targets[p]) for p, _ in self._flat]

    def _raw_model(self, leaves: list[jax.Array], buffers: Any) -> CausalLM:
        params = nnx.from_flat_state([(p, var.replace(v)) for (p, var), v in zip(self._flat, leaves)])
        return nnx.merge(self._graphdef, params, buffers)

    def _prepare(self, leaves: list[jax.Array], buffers: Any) -> list[jax.Array]:
        """`prepare` on the raw model of `leaves`: the leaves of its state that a transform made
        (the state's structure, its graphdef, the `fused` flag and which leaves are raw ones
        passed through untouched go to `_prepared_info`). Traceable: `_program` runs it as one
        jitted program, whose outputs are only the transformed leaves, so a raw array passed
        through (a norm weight; every weight where no transform applies) is not copied."""
        prepared = prepare(self.model_config, self._raw_model(leaves, buffers), **self.prepare_options)
        graphdef, state = nnx.split(prepared.net)
        flat, treedef = jax.tree.flatten(state)
        inputs = {id(x): i for i, x in enumerate([*leaves, *jax.tree.leaves(buffers)])}
        passed = {j: inputs[id(x)] for j, x in enumerate(flat) if id(x) in inputs}
        self._prepared_info = (graphdef, prepared.fused, treedef, passed)
        return [x for j, x in enumerate(flat) if j not in passed]

    def prepared_model(self, values: dict[Path, jax.Array]) -> tuple[CausalLM, bool]:
        """(prepared model, whether q/k/v and gate/up are fused) of raw `values`. One jitted
        program (compiled on the first update): XLA runs each transform (transpose + tiling,
        fusion concatenate, quantization) as one pass over the weights, where the eager ops
        took several; a model the trace cannot take is prepared eagerly."""
        leaves, buffers = self._values(values), self._buffers_state()
        if self._program is not None:
            try:
                made = self._program(leaves, buffers)
            except (jax.errors.JAXTypeError, jax.errors.JAXIndexError, TypeError) as e:
                log.warning("weight updates: the jitted prepare failed (%s); preparing eagerly", e)
                self._program = None
                made = self._prepare(leaves, buffers)
        else:
            made = self._prepare(leaves, buffers)
        graphdef, fused, treedef, passed = self._prepared_info
        inputs, it = [*leaves, *jax.tree.leaves(buffers)], iter(made)
        flat = [inputs[passed[j]] if j in passed else next(it) for j in range(treedef.num_leaves)]
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, flat)), fused

    def _touched(self, named: set[Path], fused: bool) -> set[Path]:
        """The raw module keys the update replaces; ValueError when one is named only in part."""
        owners = {raw_owner(p, fused) for p in named}
        missing = sorted(dotted(p) for p in self.targets if p not in named and raw_owner(p, fused) in owners)
        if missing:
            raise ValueError(
                f"partial update names only part of a module: also pass {missing[:20]}"
                f"{' ...' if len(missing) > 20 else ''} (a Linear's kernel goes with its bias"
                f"{'; q/k/v and gate/up are fused in this engine and go together' if fused else ''})"
            )
        return owners

    def plan(self, weights: Any, runners: list[Any], *, copy: bool = False) -> WeightPlan:
        """Check `weights` and compute every runner's new leaves; nothing is changed yet."""
        values = raw_update(weights, self.model_config, self.family, self.targets)
        if copy:
            values = {p: jnp.array(v, copy=True) for p, v in values.items()}
        full = len(values) == len(self.targets)
        if not full and self._prepared_info[0] is None:
            jax.eval_shape(self._prepare, self._values(values), self._buffers_state())  # `fused`
        owners = None if full else self._touched(set(values), self._prepared_info[1])
        net, _ = self.prepared_model(values)
        out, replaced, nbytes = [], 0, 0
        for runner in runners:
            new = runner.params_of(net)
            new_leaves, treedef = jax.tree_util.tree_flatten_with_path(new)
            if jax.tree.structure(new) != runner.param_treedef:
                raise ValueError("the updated model's parameter tree differs from the running one's")
            mine: list[jax.Array | None] = []
            for (kp, leaf), old, live in zip(new_leaves, runner.param_abstract, runner.param_leaves):
                path = _keypath_parts(kp)
                if tuple(leaf.shape) != tuple(old.shape) or leaf.dtype != old.dtype:
                    raise ValueError(
                        f"prepared tensor {dotted(path)}: {leaf.dtype}{list(leaf.shape)} differs from the "
                        f"running {old.dtype}{list(old.shape)}"
                    )
                if owners is not None:
                    layers = _owned_layers(runner, path, owners)
                    if not layers:
                        mine.append(None)
                        continue
                    if layers != [-1]:
                        leaf = _merge_layers(live, leaf, layers, path)
                mine.append(jax.device_put(leaf, old.sharding))
                replaced += 1
                nbytes += leaf.nbytes
            out.append(mine)
        return WeightPlan(out, len(values), replaced, nbytes)


def _owned_layers(runner: Any, path: Path, owners: set[Path]) -> list[int]:
    """Which part of the prepared leaf at `path` a partial update replaces: [-1] the whole
    leaf, [] none of it, else the positions along a scan_layers stack (`models.layer_scan`:
    params {"shell": model without layers, "runs": (run r's layers stacked, ...)}) whose layer
    is named."""
    if not runner.scan_layers:
        return [-1] if prepared_owner(path) in owners else []
    if path[0] == "shell":
        return [-1] if prepared_owner(path[1:]) in owners else []
    run = runner.scan_runs[path[1]]
    named = [i for i in range(run.size) if prepared_owner(("layers", run.start + i, *path[2:])) in owners]
    return [-1] if len(named) == run.size else named


def _merge_layers(live: jax.Array | None, leaf: jax.Array, layers: list[int], path: Path) -> jax.Array:
    """The running stacked leaf with positions `layers` taken from `leaf` (a new array)."""
    if live is None:
        raise ValueError(
            f"{dotted(path)}: with scan_layers a partial update of some layers of a stack needs "
            "the weights in memory (wake_up first, or name every layer)"
        )
    idx = jnp.asarray(layers, jnp.int32)
    return live.at[idx].set(jax.device_put(leaf, live.sharding)[idx])
