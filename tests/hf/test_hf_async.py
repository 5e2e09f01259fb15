"""Overlapped scheduling on every real-checkpoint family (tests/hf/conftest.py FAMILIES):
`async_scheduling=True` == the synchronous loop (greedy tokens, logprobs, finish reasons with
eos stop ids), under chunked prefill, shared prefixes and a pool tight enough to retract, with
debug mirror checks each step.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.hf.conftest import FAMILIES, NUM_PAGES  # noqa: E402
from tokenspeed_jax import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.mark.parametrize("family", FAMILIES)
def test_async_equals_sync(family, hf_checkpoints):
    path = hf_checkpoints[family][0]
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 384, 24).tolist()
    prompts = [prefix + rng.integers(0, 384, n).tolist() for n in (3, 6, 9, 13)]
    # fixed lengths (ignore_eos) and eos-stopped ones (the checkpoints' eos ids 2 and 4)
    params = [
        SamplingParams(max_tokens=16, logprobs=True, ignore_eos=i % 2 == 0) for i in range(len(prompts))
    ]
    outs, stats = {}, {}
    for a in (False, True):
        llm = LLM(
            path,
            page_size=4,
            num_pages=NUM_PAGES[family],
            max_batch_requests=4,
            max_scheduled_tokens=16,
            max_context_len=96,
            attention_backend="reference",
            debug_checks=True,
            async_scheduling=a,
        )
        outs[a] = llm.generate(prompts, params)
        stats[a] = llm.stats()
    for x, y in zip(outs[False], outs[True], strict=True):
        assert y.token_ids == x.token_ids and y.finish_reason == x.finish_reason
        np.testing.assert_allclose(y.logprobs, x.logprobs, atol=1e-5)
    assert stats[True]["num_retractions"] > 0
    assert stats[True]["free_pages"] == stats[True]["total_pages"]
