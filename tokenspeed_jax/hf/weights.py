"""Safetensors checkpoints -> the NNX `CausalLM`'s parameters.

Files: `model.safetensors.index.json` (sharded: its `weight_map` names the shard of every tensor),
else every `*.safetensors` in the directory. Names are translated in two steps:
1. family renames onto Llama-style names (LFM2 `operator_norm` -> `input_layernorm`, ...);
2. a generic rule: `model.` prefix dropped, `layers.<i>` indexed, a projection's `weight [out, in]`
   becomes our `kernel [in, out]` (transposed), norms keep `weight`, `embed_tokens.weight` is
   the `embed_tokens` table.
Special layouts: LFM2 `conv.conv.weight [H, 1, K]`, Qwen3.5 `linear_attn.conv1d.weight [C, 1, K]`
and Bamba `mamba.conv1d.weight` -> `conv_weight [K, C]`; GPT-OSS experts
`gate_up_proj [E, H, 2I]` (gate/up interleaved on the last axis) -> `gate_proj`/`up_proj [E, H, I]`,
and MXFP4-packed experts (`*_blocks` + `*_scales`, as published) are dequantized first.
The model's own (abstract) parameter tree is the spec: every target must exist with the right
shape and every parameter must be filled, else a ValueError names the offenders.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import PathParts

from tokenspeed_jax.hf.mxfp4 import dequantize_mxfp4
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.decoder import CausalLM

INDEX_FILE = "model.safetensors.index.json"
Path = PathParts  # an nnx state path: attribute names (str) and list indices (int)
# Checkpoint entries that are not parameters of the model (recomputed buffers).
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.rotary_emb\..*)$")
_LINEARS = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
    "router", "in_proj", "out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
}  # fmt: skip
# Per family: checkpoint entries of parts we do not serve (Qwen3.5: vision tower, MTP head).
_FAMILY_IGNORED = {"qwen3_5": re.compile(r"^(model\.visual\.|mtp\.)")}
_RENAMES: dict[str, list[tuple[str, str]]] = {
    "lfm2": [
        (r"\.operator_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.feed_forward\.w1\.", ".mlp.gate_proj."),
        (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
        (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.q_layernorm\.", ".q_norm."),
        (r"\.k_layernorm\.", ".k_norm."),
        (r"^model\.embedding_norm\.", "model.norm."),
        (r"\.conv\.conv\.weight$", ".conv.conv_weight"),
        (r"\.conv\.conv\.bias$", ".conv.conv_bias"),
    ],
    "qwen3_5": [
        (r"^model\.language_model\.", "model."),  # the multimodal checkpoints' text part
        (r"\.linear_attn\.conv1d\.weight$", ".linear_attn.conv_weight"),
    ],
    "bamba": [
        (r"\.feed_forward\.", ".mlp."),
        (r"\.pre_ff_layernorm\.", ".post_attention_layernorm."),
        (r"^model\.final_layernorm\.", "model.norm."),
        (r"\.mamba\.conv1d\.weight$", ".mamba.conv_weight"),
        (r"\.mamba\.conv1d\.bias$", ".mamba.conv_bias"),
    ],
}


def checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> file for a checkpoint directory; ValueError if files are missing."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        missing = sorted({s for s in weight_map.values() if not os.path.isfile(os.path.join(path, s))})
        if missing:
            raise ValueError(f"{path}: shards listed in {INDEX_FILE} are missing: {missing}")
        return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        other = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".gguf")))
        hint = f" (found {other}: only safetensors are supported)" if other else ""
        raise ValueError(f"{path}: no *.safetensors weights{hint}")
    from safetensors import safe_open

    out: dict[str, str] = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="flax") as f:
            out.update(dict.fromkeys(f.keys(), os.path.join(path, name)))
    return out


def _names_by_file(files: dict[str, str]) -> dict[str, list[str]]:
    """Tensor names grouped by shard file (so each file is opened once)."""
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    return by_file


def iter_tensors(files: dict[str, str]) -> Iterator[tuple[str, jax.Array]]:
    """(name, array) of every tensor, one shard open at a time (framework "flax" reads bf16)."""
    from safetensors import safe_open

    for file, names in _names_by_file(files).items():
        with safe_open(file, framework="flax") as f:
            for name in names:
                yield name, f.get_tensor(name)


def _st_dtype(code: str):
    """numpy dtype of a safetensors dtype code ("F32", "BF16", ...)."""
    import ml_dtypes
    import numpy as np

    named = {
        "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2,
        "BOOL": np.bool_,
    }
    if code in named:
        return np.dtype(named[code])
    kind = {"F": "float", "I": "int", "U": "uint"}.get(code[:1])
    if kind is None:
        raise ValueError(f"unsupported safetensors dtype {code}")
    return np.dtype(f"{kind}{code[1:]}")


def iter_tensor_sources(files: dict[str, str]) -> Iterator[tuple[str, Any]]:
    """Like `iter_tensors`, but nothing is read: (name, `CheckpointSource`) per tensor, so that each
    process later reads only the slices its devices hold (`sharding.place`). MXFP4 halves
    (`*_blocks`, `*_scales`) are the exception: they are dequantized whole (read here, counted in
    `param_sources.READ_STATS["whole_tensor_bytes"]`)."""
    import numpy as np
    from safetensors import safe_open

    from tokenspeed_jax.runtime.param_sources import READ_STATS, CheckpointSource

    for file, names in _names_by_file(files).items():
        with safe_open(file, framework="numpy") as f:
            for name in names:
                if name.endswith(("_blocks", "_scales")):
                    arr = np.asarray(f.get_tensor(name))
                    READ_STATS["whole_tensor_bytes"] += arr.nbytes
                    yield name, jnp.asarray(arr)
                    continue
                sl = f.get_slice(name)
                yield name, CheckpointSource(file, name, sl.get_shape(), _st_dtype(sl.get_dtype()))


def generic_path(name: str) -> tuple[Path, Callable[[jax.Array], jax.Array]]:
    """Llama-style HF name -> (our parameter path, layout transform)."""
    parts: list[str | int] = [int(p) if p.isdigit() else p for p in name.removeprefix("model.").split(".")]
    ident: Callable[[jax.Array], jax.Array] = lambda a: a
    if parts == ["embed_tokens", "weight"]:
        return ("embed_tokens",), ident
    if parts[-1] == "conv_weight":
        return tuple(parts), lambda a: a.reshape(a.shape[0], -1).T  # [H, 1, K] -> [K, H]
    if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _LINEARS:
        return (*parts[:-1], "kernel"), lambda a: a.T
    return tuple(parts), ident


def _expert_tensors(name: str, arr: jax.Array, pending: dict[str, jax.Array]) -> list[tuple[str, jax.Array]]:
    """GPT-OSS expert entries -> [(our dotted name, array)]; MXFP4 halves wait in `pending`."""
    prefix, _, leaf = name.rpartition(".")
    for kind in ("blocks", "scales"):
        if leaf.endswith("_" + kind):
            base = leaf.removesuffix("_" + kind)
            pending[f"{prefix}.{base}.{kind}"] = arr
            blocks, scales = pending.get(f"{prefix}.{base}.blocks"), pending.get(f"{prefix}.{base}.scales")
            if blocks is None or scales is None:
                return []
            del pending[f"{prefix}.{base}.blocks"], pending[f"{prefix}.{base}.scales"]
            return _expert_tensors(f"{prefix}.{base}", dequantize_mxfp4(blocks, scales), pending)
    if leaf == "gate_up_proj":  # [E, H, 2I], gate = even columns, up = odd
        return [(f"{prefix}.gate_proj", arr[..., 0::2]), (f"{prefix}.up_proj", arr[..., 1::2])]
    if leaf == "gate_up_proj_bias":
        return [(f"{prefix}.gate_bias", arr[..., 0::2]), (f"{prefix}.up_bias", arr[..., 1::2])]
    if leaf == "down_proj_bias":
        return [(f"{prefix}.down_bias", arr)]
    return [(name, arr)]  # down_proj [E, I, H] is already [in, out] per expert


def map_checkpoint(
    cfg: ModelConfig, family: str, tensors: Iterator[tuple[str, jax.Array]], targets: dict[Path, tuple]
) -> dict[Path, jax.Array]:
    """Translated parameters `{path: array}` cast to `cfg.dtype`, checked against `targets`
    (path -> expected shape). Raises ValueError on unknown names or shape mismatches."""
    dtype = jnp.dtype(cfg.dtype)
    out: dict[Path, jax.Array] = {}
    unknown, bad_shape = [], []
    pending: dict[str, jax.Array] = {}
    for hf_name, arr in tensors:
        if _IGNORED.match(hf_name) or (cfg.tie_word_embeddings and hf_name == "lm_head.weight"):
            continue
        if family in _FAMILY_IGNORED and _FAMILY_IGNORED[family].match(hf_name):
            continue
        name = hf_name
        for pat, rep in _RENAMES.get(family, []):
            name = re.sub(pat, rep, name)
        pairs = _expert_tensors(name, arr, pending) if ".mlp.experts." in name else [(name, arr)]
        for sub_name, sub in pairs:
            path, transform = generic_path(sub_name)
            if path not in targets:
                unknown.append(hf_name)
                continue
            value = transform(sub)
            if tuple(value.shape) != tuple(targets[path]):
                bad_shape.append(f"{hf_name}: {tuple(value.shape)} vs expected {tuple(targets[path])}")
                continue
            out[path] = value.astype(dtype)
    unknown += sorted(pending)
    if unknown or bad_shape:
        raise ValueError(
            f"checkpoint does not fit the {family} model: unexpected tensors {sorted(unknown)[:20]}"
            f"{' ...' if len(unknown) > 20 else ''}; shape mismatches {bad_shape[:20]}"
        )
    return out


def load_model(cfg: ModelConfig, family: str, files: dict[str, str], *, lazy: bool = False) -> CausalLM:
    """Builds the `CausalLM` of `cfg` with every parameter taken from the checkpoint files.

    lazy=True: every parameter is a `param_sources.CheckpointSource` (nothing read yet; the
    multi-process path, where each process reads only its shards when the runner places them)."""
    return load_model_from_tensors(cfg, family, iter_tensor_sources(files) if lazy else iter_tensors(files))


def load_model_from_tensors(
    cfg: ModelConfig, family: str, tensors: Iterator[tuple[str, jax.Array]]
) -> CausalLM:
    """Builds the `CausalLM` of `cfg` from (HF name, array) pairs (safetensors or GGUF).

    The model is created abstractly (no random init of real-size weights); non-parameter
    variables (RoPE tables) come from a jitted construction whose parameter init XLA discards.
    """
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    # two filters give exactly three parts; nnx.split's annotation types the tail as variadic
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]
    flat = list(nnx.to_flat_state(params))
    targets = {path: var.get_value().shape for path, var in flat}
    loaded = map_checkpoint(cfg, family, tensors, targets)
    missing = [".".join(map(str, p)) for p in targets if p not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing parameters of the {family} model: {missing[:20]}")
    params = nnx.from_flat_state([(p, var.replace(loaded[p])) for p, var in flat])

    @jax.jit
    def buffers():
        return nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)[2]

    rest = buffers() if len(list(nnx.to_flat_state(rest))) else rest
    return nnx.merge(graphdef, params, rest)
