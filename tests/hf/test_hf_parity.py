"""`LLM(model=DIR)` on every family vs transformers (float32, CPU), through the whole engine:
page size 4, chunked prefill (16-token steps), prefix cache, a pool tight enough to retract.

- teacher-forced prompt_logprobs == transformers' log-softmax (prompts longer than the window);
- greedy continuations of several requests sharing a prefix, in one batch == `generate` token
  for token (a first divergence is accepted only at a tie closer than 1e-3 in transformers'
  logits), and the logprobs of the generated tokens match;
- the same batch again hits the prefix cache and returns the same tokens;
- string prompts go through tokenizer.json like transformers' tokenizer, and text comes back;
  seeded sampling reproduces whatever else shares the batch.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.hf.conftest import FAMILIES, NUM_PAGES  # noqa: E402
from tokenspeed_jax import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.hf

TOL = 1e-3
NEW_TOKENS = 16
PREFIX = 24  # shared prefix: 6 full pages of 4 tokens (prefix-cacheable)
SUFFIXES = (3, 6, 9, 13)
MAX_DELTA: dict[str, float] = {}  # family -> max |dlogprob| seen (printed by the last test)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, hf_checkpoints):
    family = request.param
    path, ref = hf_checkpoints[family]
    ref.generation_config.eos_token_id = None  # compare fixed-length continuations
    llm = LLM(path, page_size=4, num_pages=NUM_PAGES[family], max_batch_requests=4, max_scheduled_tokens=16,
              max_context_len=96, attention_backend="reference", debug_checks=True,
              lazy_compile="sync")  # fmt: skip
    return family, llm, ref


def _note(family: str, delta: float) -> None:
    MAX_DELTA[family] = max(MAX_DELTA.get(family, 0.0), float(delta))


def _hf_logprobs(ref, ids) -> np.ndarray:
    with torch.no_grad():
        logits = ref(torch.tensor([list(ids)])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def test_prompt_logprobs_match_transformers(served):
    family, llm, ref = served
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 384, n).tolist() for n in (37, 45)]  # > every window, 3 chunks
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=True))
    for prompt, out in zip(prompts, outs, strict=True):
        want = _hf_logprobs(ref, prompt)[np.arange(len(prompt) - 1), prompt[1:]]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        delta = np.abs(np.asarray(out.prompt_logprobs[1:], np.float64) - want).max()
        _note(family, delta)
        assert delta < TOL, f"{family}: max |dlogprob| {delta:.2e}"


def _check_greedy(family: str, out, ref, prompt: list[int]) -> int:
    """Asserts the continuation matches `generate`; returns how many tokens were compared."""
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                           eos_token_id=None, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True)  # fmt: skip
    want = gen.sequences[0, len(prompt) :].tolist()
    logps = [torch.log_softmax(lg[0].float(), -1).numpy() for lg in gen.logits]
    assert len(out.token_ids) == NEW_TOKENS
    for j, (got_tok, want_tok) in enumerate(zip(out.token_ids, want, strict=True)):
        if got_tok != want_tok:  # only a near-tie may flip greedy; later tokens then differ
            gap = logps[j][want_tok] - logps[j][got_tok]
            assert gap < TOL, f"{family}: token {j}: {got_tok} != {want_tok} (logit gap {gap:.2e})"
            return j
        delta = abs(out.logprobs[j] - logps[j][got_tok])
        _note(family, delta)
        assert delta < TOL, f"{family}: logprob of token {j} off by {delta:.2e}"
    return NEW_TOKENS


def test_greedy_shared_prefix_batch_matches_generate(served):
    family, llm, ref = served
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 384, PREFIX).tolist()
    prompts = [prefix + rng.integers(0, 384, n).tolist() for n in SUFFIXES]
    sp = SamplingParams(max_tokens=NEW_TOKENS, logprobs=True, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    compared = sum(_check_greedy(family, out, ref, p) for p, out in zip(prompts, outs, strict=True))
    assert compared >= len(prompts) * NEW_TOKENS // 2, "ties cut the comparison too short"
    hits = llm.stats()["prefix_hit_tokens"]
    again = llm.generate(prompts, sp)
    stats = llm.stats()
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    np.testing.assert_allclose([o.logprobs for o in again], [o.logprobs for o in outs], atol=1e-4)
    assert stats["prefix_hit_tokens"] > hits, "the second batch should reuse the cached prefix"
    assert stats["num_retractions"] > 0, "the pool was sized to force retraction"
    assert stats["free_pages"] == stats["total_pages"]  # nothing leaked


def test_strings_and_seeded_sampling(served, hf_checkpoints):
    family, llm, ref = served
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(hf_checkpoints[family][0])
    text = "You are a helpful assistant. The quick brown fox"
    out = llm.generate(text, SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == tok(text)["input_ids"]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    # Seeded sampling on a real checkpoint reproduces whatever else shares the batch.
    sp = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    alone = llm.generate(text, sp)[0].token_ids
    other = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    crowd = llm.generate([text, "Mixture of experts", text + " jumps"], [sp, other, other])
    assert crowd[0].token_ids == alone
    print(f"\n{family}: max |dlogprob| vs transformers = {MAX_DELTA.get(family, float('nan')):.2e}")
