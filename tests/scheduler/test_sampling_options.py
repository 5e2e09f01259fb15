"""`SamplingOptions`: one validated sampling record from the API to the StepOps builder."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

from scheduler import SamplingOptions, Scheduler, SchedulerConfig, StepOps
from scheduler.sampling_options import COLUMNS, DERIVED, LIMITS
from scheduler.step_ops import LOGIT_BIAS_WIDTH


def _sched(**kw):
    cfg = dict(
        num_pages=32,
        page_size=4,
        max_batch_requests=4,
        max_scheduled_tokens=16,
        max_context_len=32,
        debug_checks=True,
    )
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


@pytest.mark.parametrize("name", DERIVED)
@pytest.mark.parametrize("value", [True, False])
def test_derived_flags_are_not_options(name, value):
    s = _sched()
    with pytest.raises(ValueError, match=f"unknown options.*{name}"):
        s.add_request("a", [1, 2, 3], 4, **{name: value})
    assert not s.has_unfinished() and s.get_request("a") is None
    with pytest.raises(TypeError):
        SamplingOptions(**{name: value})


def test_derived_flags_follow_the_fields():
    assert not SamplingOptions().has_penalties and not SamplingOptions().needs_extras
    for kw in (dict(presence_penalty=0.5), dict(frequency_penalty=-1), dict(repetition_penalty=2)):
        o = SamplingOptions(**kw)
        assert o.has_penalties and o.needs_extras
    for kw in (dict(logit_bias={3: 1.0}), dict(top_logprobs=2)):
        o = SamplingOptions(**kw)
        assert o.needs_extras and not o.has_penalties
    o = SamplingOptions(temperature=0.7, top_p=0.5, top_k=3, seed=1, prompt_logprobs=True)
    assert not o.needs_extras and not o.has_penalties


# (field, a value it allows, a value it refuses): every field of the record
CASES = [
    ("temperature", 0.7, -0.5),
    ("temperature", 0, float("inf")),
    ("top_p", 1.0, 0.0),
    ("top_p", 0.5, 1.5),
    ("top_k", -1, 0),
    ("top_k", 5, -2),
    ("top_k", 5, 2.5),
    ("seed", 2**40, -1),
    ("seed", None, 1.5),
    ("stop_token_ids", [1, 2], [1, -2]),
    ("stop_token_ids", None, 7),
    ("presence_penalty", -2.0, 2.5),
    ("frequency_penalty", 2, float("nan")),
    ("repetition_penalty", 1e4, 0.0),
    ("logit_bias", {5: 100.0}, {5: 100.5}),
    ("logit_bias", {0: -1}, {-1: 1.0}),
    ("logit_bias", {i: 1.0 for i in range(LOGIT_BIAS_WIDTH)}, {i: 1.0 for i in range(LOGIT_BIAS_WIDTH + 1)}),
    ("top_logprobs", 20, 21),
    ("top_logprobs", 0, True),
]


def test_cases_cover_every_checked_field():
    assert {name for name, _, _ in CASES} == set(LIMITS) - {"prompt_logprobs"}


@pytest.mark.parametrize("name,good,bad", CASES)
def test_one_limits_table_for_record_scheduler_and_params(name, good, bad):
    from tokenspeed_jax.sampling_params import SamplingParams  # jax-free

    SamplingOptions.from_options({name: good})
    SamplingParams(**{name: good})
    _sched().add_request("a", [1, 2], 3, **{name: good})
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingOptions(**{name: bad})
    with pytest.raises(ValueError, match=f"^SamplingParams.{name} must be"):
        SamplingParams(**{name: bad})
    s = _sched()
    with pytest.raises(ValueError, match=f"^request 'a': {name} must be"):
        s.add_request("a", [1, 2], 3, **{name: bad})
    assert not s.has_unfinished()


def test_record_normalises():
    o = SamplingOptions.from_options(
        dict(
            temperature=1,
            top_k=np.int64(4),
            seed=2**32 + 9,
            stop_token_ids=[7, 7, 3],
            logit_bias={9: 1, 2: -0.5},
            top_logprobs=None,
            presence_penalty=None,
        )
    )
    assert o.temperature == 1.0 and isinstance(o.temperature, float)
    assert o.top_k == 4 and type(o.top_k) is int
    assert o.seed == 9  # low 32 bits
    assert o.stop_token_ids == frozenset({3, 7})
    assert o.logit_bias == ((2, -0.5), (9, 1.0))
    assert o.top_logprobs == 0 and o.presence_penalty == 0.0  # None = the default
    hash(o)  # frozen, hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.temperature = 0.5  # type: ignore[misc]


def test_request_carries_the_record_whole_with_a_resolved_seed():
    s = _sched()
    s.add_request("kw", [1, 2, 3], 4, temperature=0.5, top_k=3, top_logprobs=2)
    rec = SamplingOptions(temperature=0.5, top_k=3, top_logprobs=2, seed=77)
    s.add_request("rec", [1, 2, 3], 4, sampling=rec)
    kw = s.get_request("kw").sampling
    assert kw == dataclasses.replace(rec, seed=zlib.crc32(b"kw"))
    assert s.get_request("rec").sampling is rec
    for old in (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "logit_bias",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        assert not hasattr(s.get_request("kw"), old)


def test_sampling_record_and_keyword_options_do_not_mix():
    s = _sched()
    with pytest.raises(ValueError, match="beside sampling"):
        s.add_request("a", [1, 2], 3, sampling=SamplingOptions(), temperature=0.5)
    with pytest.raises(ValueError, match="SamplingOptions"):
        s.add_request("a", [1, 2], 3, sampling={"temperature": 0.5})
    assert not s.has_unfinished()
    s.add_request("a", [1, 2], 3, sampling=SamplingOptions(), cache_salt="tenant")


def test_columns_are_padded_stepops_fields_whose_padding_is_the_default():
    meta = {f.name: f.metadata for f in dataclasses.fields(StepOps)}
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingOptions)}
    # the padded per-row fields that are no sampling option: prompt lengths, speculative drafts
    filled = {"prompt_lens", "draft_lens"}
    for c in COLUMNS:
        filled.update(c.columns)
        for col in c.columns:
            assert "pad" in meta[col], col
        if len(c.columns) == 1 and defaults[c.field] is not None:
            assert defaults[c.field] == meta[c.columns[0]]["pad"], c.field  # "off" == padding
    assert filled == {name for name, m in meta.items() if "pad" in m}


def test_builder_fills_each_row_from_its_record():
    s = _sched()
    s.add_request("a", [1, 2, 3], 4)
    s.add_request(
        "b",
        [4, 5],
        4,
        temperature=0.9,
        top_p=0.8,
        top_k=7,
        seed=5,
        presence_penalty=0.25,
        repetition_penalty=1.5,
        logit_bias={11: 2.0, 3: -1.0},
        top_logprobs=4,
    )
    ops = s.schedule()
    assert ops.request_ids == ("a", "b")
    b = 1
    assert ops.temperature[b] == np.float32(0.9) and ops.top_p[b] == np.float32(0.8)
    assert ops.top_k[b] == 7 and ops.seeds[b] == 5
    assert ops.presence_penalty[b] == 0.25 and ops.frequency_penalty[b] == 0.0
    assert ops.repetition_penalty[b] == 1.5 and ops.top_logprobs[b] == 4
    assert ops.logit_bias_ids[b, :3].tolist() == [3, 11, -1]
    assert ops.logit_bias_values[b, :2].tolist() == [-1.0, 2.0]
    # row a and the padding rows keep the padding
    assert ops.temperature[0] == 0 and ops.top_k[0] == -1 and ops.seeds[0] == zlib.crc32(b"a")
    assert (ops.logit_bias_ids[[0, 2, 3]] == -1).all() and ops.repetition_penalty[0] == 1.0
    assert ops.top_k[2:].tolist() == [-1, -1] and ops.top_p[2:].tolist() == [1.0, 1.0]


def test_sampling_params_build_the_record_in_one_call():
    from tokenspeed_jax.sampling_params import SamplingParams  # jax-free

    p = SamplingParams(
        max_tokens=3,
        temperature=0.5,
        stop_token_ids=[9],
        seed=4,
        logit_bias={2: 1.0},
        top_logprobs=3,
        prompt_logprobs=True,
    )
    o = p.to_options(eos_token_ids=(1, 2))
    assert o == SamplingOptions(
        temperature=0.5,
        stop_token_ids=frozenset({1, 2, 9}),
        seed=4,
        logit_bias=((2, 1.0),),
        top_logprobs=3,
        prompt_logprobs=True,
    )
    assert dataclasses.replace(p, ignore_eos=True).to_options((1, 2)).stop_token_ids == {9}
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams().to_options() == SamplingOptions()
