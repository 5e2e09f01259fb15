"""N-gram speculative decoding on one real-checkpoint family per cache shape (full attention:
llama; sliding: mistral; conv: lfm2; sinks + MoE: gpt_oss; Gemma: gemma3; tests/hf/conftest.py):
greedy tokens and finish reasons equal the engine without speculation (eos stop ids included),
under chunked prefill, shared prefixes and a pool tight enough to retract, debug mirror checks
each step, no page leaked. Prompts repeat themselves so the proposer finds n-grams to draft.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.hf.test_hf_async import NUM_PAGES  # noqa: E402
from tokenspeed_jax import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.hf

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("family", ["llama", "mistral", "lfm2", "gpt_oss", "gemma3"])
def test_speculative_equals_plain(family, hf_checkpoints):
    path = hf_checkpoints[family][0]
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 384, 16).tolist()
    motif = rng.integers(0, 384, 5).tolist()
    prompts = [prefix + motif * r for r in (2, 3, 4)] + [motif * 3]
    params = [SamplingParams(max_tokens=14, ignore_eos=i % 2 == 0) for i in range(len(prompts))]
    outs, stats = {}, {}
    for spec in (None, SPEC):
        llm = LLM(
            path,
            page_size=4,
            num_pages=NUM_PAGES[family] + 4,
            max_batch_requests=4,
            max_scheduled_tokens=16,
            max_context_len=96,
            attention_backend="reference",
            debug_checks=True,
            speculative_config=spec,
            lazy_compile="sync",  # only the shapes the run takes compile (the outputs are the same)
            min_token_bucket=16,  # as speculation has it: no 1-token bucket for the plain run either
        )
        outs[spec is not None] = llm.generate(prompts, params)
        stats[spec is not None] = llm.stats()
    for x, y in zip(outs[False], outs[True], strict=True):
        assert y.token_ids == x.token_ids and y.finish_reason == x.finish_reason
    s = stats[True]
    assert s["spec_draft_tokens"] > 0
    assert s["free_pages"] == s["total_pages"]
