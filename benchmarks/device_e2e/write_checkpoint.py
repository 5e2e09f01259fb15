"""Step 1: a Llama-3.1-8B-shaped random bf16 checkpoint (config with llama3 RoPE, sharded
safetensors + index) in RAM-backed scratch. The arrays are drawn on the accelerator
(jax.random, one tensor at a time) and written with safetensors; nothing downloads.

Scales: N(0, 0.02) like HF's init, norms 1, and the LM head N(0, 2 / sqrt(hidden)) so the
next-token distribution is peaked (logit std ~2 on unit-RMS hidden states): with HF's 0.02 a random
8B model's logits are near-uniform and greedy argmax would compare rounding noise.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import common  # noqa: F401  (sys.path)
from common import CKPT, MODEL, REHEARSE, param_count, result


def tensors(cfg: dict):
    """(HF name, shape, std) of every tensor of the Llama checkpoint."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    yield "model.embed_tokens.weight", (v, h), 0.02
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,), None
        yield p + "post_attention_layernorm.weight", (h,), None
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            yield p + f"self_attn.{name}.weight", shape, 0.02
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield p + f"mlp.{name}.weight", shape, 0.02
    yield "model.norm.weight", (h,), None
    yield "lm_head.weight", (v, h), 2.0 / h**0.5


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import save_file

    t0 = time.perf_counter()
    shutil.rmtree(CKPT, ignore_errors=True)
    os.makedirs(CKPT)
    cfg = dict(
        MODEL, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", dtype="bfloat16",
    )  # fmt: skip
    with open(os.path.join(CKPT, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    shard_bytes = (1 << 20) if REHEARSE else (5 << 30)  # several shards + an index, as HF writes
    key = jax.random.PRNGKey(0)
    shard: dict = {}
    weight_map, files, total = {}, [], 0

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(CKPT, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard.clear()

    size = 0
    for n, (name, shape, std) in enumerate(tensors(MODEL)):
        if std is None:
            arr = np.ones(shape, jnp.bfloat16)
        else:
            x = jax.random.normal(jax.random.fold_in(key, n), shape, jnp.float32) * std
            arr = np.asarray(x.astype(jnp.bfloat16))
            del x
        shard[name] = arr
        size += arr.nbytes
        total += arr.nbytes
        if size >= shard_bytes:
            flush()
            size = 0
    if shard:
        flush()
    # the index names the real shard count
    with open(os.path.join(CKPT, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    result(
        "1_checkpoint",
        path=CKPT,
        shards=len(files),
        bytes=total,
        params=param_count(MODEL),
        seconds=time.perf_counter() - t0,
        device=str(jax.devices()[0]),
    )


if __name__ == "__main__":
    main()
