"""GGUF checkpoints (llama.cpp's single-file format) -> our model, via the `gguf` package.

`load_gguf(path, dtype=...) -> (ModelConfig, CausalLM, tokenizer)` is what `LLM(model="x.gguf")`
calls. Steps:
1. metadata -> a Hugging Face style config dict (`{arch}.block_count` -> num_hidden_layers, ...),
   then the same `model_config_from_hf` the safetensors loader uses;
2. every tensor dequantized with `gguf.quants.dequantize` (F32/F16/BF16/Q8_0/Q4_0/Q4_1/K-quants,
   whatever the package implements) to float32 `[out, in]` rows, renamed to HF names
   (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`), then mapped and cast to
   `dtype` by `weights.map_checkpoint` (so shape / unknown-tensor checks are shared);
3. llama.cpp's converter permutes the rows of attn_q / attn_k so each head's rotary pairs are
   interleaved (GPT-J layout); `unpermute_rope_rows` restores the rotate-half layout our RoPE uses;
4. the tokenizer and chat template from `tokenizer.*` metadata (`hf/gguf_tokenizer.py`);
5. keep_quantized (`LLM(..., quantization="gguf")`): every Linear stored as Q8_0 / Q4_0 / Q4_1
   then holds the file's blocks (`read_blocks` -> `Linear.set_blocks`, `models/block_quant.py`)
   in place of its float kernel, and a tied embedding table stored so keeps them too
   (`CausalLM.set_table_blocks`: the lm_head through the native block kernel). Other types
   (F16/F32, K-quants) and an untied lm_head stay float.
   The float model is still built first, so loading peaks at the float size once.
Only Llama-family files (`general.architecture == "llama"`) are mapped; others are a ValueError.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from tokenspeed_jax.models.config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM"}
# GGUF tensor-name pieces -> Hugging Face Llama names.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _require_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ValueError("loading .gguf files needs the 'gguf' package (pip install gguf)") from e
    return gguf


def read_gguf(path: str):
    """A `gguf.GGUFReader` over `path` (memory-mapped); ValueError if it is not a GGUF file."""
    gguf = _require_gguf()
    if not os.path.isfile(path):
        raise ValueError(f"{path!r}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def metadata(reader) -> dict[str, Any]:
    """Every metadata field as a Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A Hugging Face `config.json`-style dict from GGUF metadata; ValueError if unmapped."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
        raise ValueError(f"GGUF architecture {arch!r} is not mapped yet (supported: {supported})")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ValueError("GGUF metadata has neither a vocab_size nor tokenizer tokens")
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    if get("rope.dimension_count") not in (None, head_dim):
        raise ValueError("partial rotary embeddings (rope.dimension_count < head dim) are not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF rope_freqs (llama3-style rope factors) are not supported yet")
    hf: dict[str, Any] = {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length") or 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    kind = get("rope.scaling.type")
    if kind not in (None, "none"):
        factor = float(get("rope.scaling.factor", 1.0))
        if kind != "linear":
            raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: linear)")
        hf["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return hf


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. w f[n_head * head_dim, in].

    The converter reorders each head's rows `[first half | second half]` into interleaved pairs
    `(0, D/2), (1, D/2+1), ...`; reading them back as `[D/2, 2]` and transposing restores them.
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face Llama name; ValueError for names we do not map."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no mapping onto the Llama model")


def iter_dequantized(reader, hf: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF layout) of every tensor, one at a time."""
    gguf = _require_gguf()
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    for tensor in reader.tensors:
        try:
            arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise ValueError(
                f"GGUF tensor {tensor.name}: quantization {tensor.tensor_type.name} "
                f"cannot be dequantized by the gguf package: {e}"
            ) from e
        arr = np.asarray(arr, dtype=np.float32)
        if ".attn_q." in tensor.name:
            arr = unpermute_rope_rows(arr, heads)
        elif ".attn_k." in tensor.name:
            arr = unpermute_rope_rows(arr, kv_heads)
        yield hf_name(tensor.name), arr


# bytes per block of 32 weights: f16 scale (+ f16 min for Q4_1), then the codes
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def read_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw GGUF rows uint8[rows, bytes] of a Q8_0 / Q4_0 / Q4_1 tensor -> (codes int8[rows,
    cols], scales f32[rows, cols / 32], mins f32[rows, cols / 32] or None), so that
    w = scales * codes (+ mins) per block of 32 columns (ggml's block layouts)."""
    size = _BLOCK_BYTES.get(kind)
    if size is None:
        raise ValueError(f"GGUF type {kind} cannot be kept as blocks (supported: {', '.join(_BLOCK_BYTES)})")
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{raw.shape=}: rows of {kind} blocks must be a multiple of {size} bytes")
    b = raw.reshape(raw.shape[0], -1, size)  # [rows, blocks, bytes]
    scales = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mins = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    if kind == "Q8_0":
        codes = b[..., 2:].copy().view(np.int8)
    else:  # 16 bytes: low nibbles are the block's first 16 weights, high nibbles the last 16
        qs = b[..., size - 16 :]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8)
        if kind == "Q4_0":
            codes = codes - np.int8(8)
    return codes.reshape(raw.shape[0], -1), scales, mins


def _keep_blocks(model, reader, hf: dict[str, Any]) -> int:
    """Replace the float kernel of every Linear stored as blocks by the blocks; how many."""
    import jax.numpy as jnp

    from tokenspeed_jax.hf.weights import generic_path

    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    n = 0
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if tensor.name == "token_embd.weight" and kind in _BLOCK_BYTES and model.lm_head is None:
            # a tied table: the lm_head's weight too, read every decode step
            codes, scales, mins = read_blocks(tensor.data, kind)
            model.set_table_blocks(
                jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(mins) if mins is not None else None
            )
            continue
        path, _ = generic_path(hf_name(tensor.name))
        if kind not in _BLOCK_BYTES or path[-1] != "kernel" or path[0] == "lm_head":
            continue  # dequantized (F16/F32, K-quants), or the embedding table / lm_head
        codes, scales, mins = read_blocks(tensor.data, kind)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            h = heads if ".attn_q." in tensor.name else kv_heads
            codes, scales = unpermute_rope_rows(codes, h), unpermute_rope_rows(scales, h)
            mins = unpermute_rope_rows(mins, h) if mins is not None else None
        module = model
        for p in path[:-1]:
            module = module[p] if isinstance(p, int) else getattr(module, str(p))
        module.set_blocks(
            jnp.asarray(codes.T), jnp.asarray(scales.T), jnp.asarray(mins.T) if mins is not None else None
        )
        n += 1
    return n


def load_gguf_config(path: str, *, dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` of a GGUF file (metadata only; no tensor is dequantized)."""
    from tokenspeed_jax.hf.config import model_config_from_hf

    reader = read_gguf(path)
    hf = hf_config_from_gguf(metadata(reader), {t.name for t in reader.tensors})
    return model_config_from_hf(hf, dtype="float32" if dtype == "auto" else dtype)


def load_gguf(path: str, *, dtype: str = "float32", keep_quantized: bool = False):
    """(ModelConfig, CausalLM, tokenizer or None) of a GGUF file, weights cast to `dtype`.

    dtype "auto" means float32 (a quantized file has no single native float type).
    keep_quantized: Linears stored as Q8_0 / Q4_0 / Q4_1 keep their blocks (step 5 above).
    """
    import jax.numpy as jnp

    from tokenspeed_jax.hf.config import model_config_from_hf
    from tokenspeed_jax.hf.gguf_tokenizer import tokenizer_from_gguf
    from tokenspeed_jax.hf.weights import load_model_from_tensors

    reader = read_gguf(path)
    meta = metadata(reader)
    hf = hf_config_from_gguf(meta, {t.name for t in reader.tensors})
    cfg = model_config_from_hf(hf, dtype="float32" if dtype == "auto" else dtype)
    tensors = ((name, jnp.asarray(arr)) for name, arr in iter_dequantized(reader, hf))
    model = load_model_from_tensors(cfg, "llama", tensors)
    if keep_quantized and not _keep_blocks(model, reader, hf):
        raise ValueError(f"{path!r} has no Q8_0 / Q4_0 / Q4_1 Linear weights to keep (quantization='gguf')")
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, tuple) else (() if eos is None else (eos,))
    return cfg, model, tokenizer_from_gguf(meta, model_eos=eos_ids)
