"""What `LLM.update_weights` accepts, turned into raw parameters `{path: array}` (issue 48).

"Raw" = the model as the loaders build it, before `runtime.prepare` (Linear kernels `[in, out]`,
q / k / v and gate / up separate, float, unsharded). Accepted:

* a checkpoint directory (safetensors, same family and shapes): read as at load
  (`hf.weights.iter_tensors`) and translated by `hf.weights.map_checkpoint`;
* a mapping or an iterable of `(name, array)` pairs, arrays numpy, jax or anything with
  `__array__`. A name is either a Hugging Face tensor name (`model.layers.0.self_attn.q_proj.
  weight [out, in]`: renamed and transposed as at load, for the built-in model too: its modules
  carry Llama's names) or one of our raw parameter paths, dotted (`layers.0.self_attn.q_proj.
  kernel [in, out]`), taken as is;
* a JAX trainer's params as it holds them: an `nnx.Module` (its `nnx.Param`s), an `nnx.State`,
  or a nested dict / pytree whose key paths are our raw paths (`nnx.state(model, nnx.Param)` of
  a `CausalLM` built like ours).

Checks, before anything changes (ValueError naming the tensor): unknown names, shapes, and dtypes
(floating only: a float tensor is cast to the model's dtype, an integer / bool / complex one is
refused). A jax array is never copied to the host: its transforms run where it lives.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.hf.weights import Path, checkpoint_files, iter_tensors, map_checkpoint
from tokenspeed_jax.models.config import ModelConfig


def dotted(path: Path) -> str:
    """Our raw path as a dotted name: ("layers", 0, "mlp", "up_proj", "kernel") ->
    "layers.0.mlp.up_proj.kernel"."""
    return ".".join(str(p) for p in path)


def hf_tensors(params: Any) -> dict[str, np.ndarray]:
    """Raw params (an nnx.Module, nnx.State or params pytree of a `CausalLM`) as Llama-style
    Hugging Face tensors, host numpy: the inverse of `hf.weights.generic_path` (Linear kernels
    back to `weight [out, in]`, conv weights to `[H, 1, K]`, `model.` prefixed). With
    `safetensors.numpy.save_file` this writes a checkpoint directory `update_weights` (and
    `/update_weights_from_disk`) reads, e.g. of the built-in model."""
    out: dict[str, np.ndarray] = {}
    for name, leaf in _pairs(params):
        arr = np.asarray(leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf)
        last = name.rsplit(".", 1)[-1]
        if name == "embed_tokens":
            name = "embed_tokens.weight"
        elif last == "kernel":
            name, arr = name.removesuffix(".kernel") + ".weight", arr.T
        elif last == "conv_weight":
            arr = arr.T[:, None, :]  # [K, H] -> [H, 1, K]
        out["model." + name] = np.ascontiguousarray(arr)
    return out


def _as_array(name: str, x: Any) -> jax.Array | np.ndarray:
    """x as a jax or numpy array whose dtype is floating; ValueError naming `name` otherwise."""
    if isinstance(x, nnx.Variable):
        x = x.get_value()
    if not isinstance(x, (jax.Array, np.ndarray)):
        try:
            x = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - anything without a usable __array__
            raise ValueError(
                f"tensor {name!r}: cannot read it as an array ({type(x).__name__}: {e})"
            ) from None
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"tensor {name!r}: dtype {x.dtype} is not a floating type (weights are cast from floats only)"
        )
    return x


def _keypath_parts(keypath: tuple) -> tuple:
    parts: list[Any] = []
    for k in keypath:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if name == "value":  # an nnx.Variable's leaf
            continue
        parts.append(int(name) if isinstance(name, str) and name.isdigit() else name)
    return tuple(parts)


def _pytree_pairs(tree: Any) -> list[tuple[str, Any]]:
    """(dotted raw path, leaf) of a params pytree (nnx.State, nested dicts, ...)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    return [(dotted(_keypath_parts(kp)), leaf) for kp, leaf in leaves]


def _pairs(weights: Any) -> Iterable[tuple[str, Any]]:
    """The (name, array-like) pairs of any accepted form but a directory."""
    if isinstance(weights, nnx.Module):
        return _pytree_pairs(nnx.state(weights, nnx.Param))
    if isinstance(weights, nnx.State):
        return _pytree_pairs(weights)
    if isinstance(weights, Mapping):
        if any(isinstance(v, (Mapping, nnx.State, list, tuple)) for v in weights.values()):
            return _pytree_pairs(weights)  # nested: a params pytree
        return weights.items()
    if isinstance(weights, Iterable) and not isinstance(weights, (str, bytes)):
        return weights
    raise ValueError(
        f"weights must be a checkpoint directory, a mapping or iterable of (name, array) pairs, "
        f"an nnx.Module or an nnx.State; got {type(weights).__name__}"
    )


def raw_update(
    weights: Any, cfg: ModelConfig, family: str, targets: dict[Path, tuple[int, ...]]
) -> dict[Path, jax.Array]:
    """The update's raw parameters `{path: array in cfg.dtype}`; `targets`: raw path -> shape.

    ValueError (nothing changed anywhere) naming the tensors with an unknown name, a wrong shape
    or a non-floating dtype, or when the update names no tensor at all."""
    dtype = jnp.dtype(cfg.dtype)
    by_name = {dotted(p): p for p in targets}
    if isinstance(weights, (str, os.PathLike)):
        path = os.fspath(weights)
        if not os.path.isdir(path):
            raise ValueError(f"weights path {path!r} is not a checkpoint directory")
        hf_pairs: Iterator[tuple[str, Any]] = iter_tensors(checkpoint_files(path))
        native: list[tuple[str, Any]] = []
    else:
        hf: list[tuple[str, Any]] = []
        native = []
        for item in _pairs(weights):
            try:
                name, value = item
            except (TypeError, ValueError):
                raise ValueError(f"expected (name, array) pairs, got {item!r:.80}") from None
            if not isinstance(name, str):
                raise ValueError(f"tensor names must be strings, got {name!r:.80}")
            (native if name in by_name else hf).append((name, _as_array(name, value)))
        hf_pairs = iter(hf)
    out: dict[Path, jax.Array] = {}
    bad: list[str] = []
    for name, value in native:
        want = tuple(targets[by_name[name]])
        if tuple(value.shape) != want:
            bad.append(f"{name}: {tuple(value.shape)} vs expected {want}")
            continue
        out[by_name[name]] = jnp.asarray(value).astype(dtype)
    if bad:
        raise ValueError(f"update does not fit the model: shape mismatches {bad[:20]}")

    def checked() -> Iterator[tuple[str, Any]]:
        for name, value in hf_pairs:
            yield name, _as_array(name, value)

    for path, value in map_checkpoint(cfg, family, checked(), targets).items():
        if path in out:
            raise ValueError(f"tensor {dotted(path)!r} is given twice (under two names)")
        out[path] = jnp.asarray(value)
    if not out:
        raise ValueError("the update names no tensor of the model")
    return out
