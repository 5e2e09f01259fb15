"""SamplingParams and the engine accept what numpy-based callers pass: None stop ids (vLLM
accepts it) and numpy integers as token ids, stop ids and max_tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tokenspeed_jax import LLM, SamplingParams


def test_stop_token_ids_none_is_no_stop_ids():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_numpy_integers_accepted_and_normalised():
    p = SamplingParams(
        max_tokens=np.int32(4),
        stop_token_ids=np.array([3, 4], dtype=np.int64),
        seed=np.uint32(7),
        top_k=np.int64(5),
        logit_bias={np.int64(2): 1.0},
    )
    assert p.max_tokens == 4 and type(p.max_tokens) is int
    assert p.stop_token_ids == (3, 4) and all(type(t) is int for t in p.stop_token_ids)
    assert p.seed == 7 and p.top_k == 5 and p.logit_bias == {2: 1.0}
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=np.int64(0))


def test_engine_takes_numpy_prompt_ids():
    llm = LLM(
        "tiny-random",
        num_pages=32,
        page_size=8,
        max_batch_requests=2,
        max_scheduled_tokens=16,
        max_context_len=64,
    )
    params = SamplingParams(max_tokens=np.int64(3), stop_token_ids=None, ignore_eos=True)
    checked = llm.engine.validate(np.array([256, 72, 105], dtype=np.int32), params)
    assert checked.ids == [256, 72, 105] and all(type(t) is int for t in checked.ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.validate(np.array([1, 10_000]), params)
