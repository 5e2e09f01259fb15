"""Structured outputs end to end on the built-in random model: every constrained output obeys its
constraint (JSON schema validated with jsonschema, regex / choice / grammar matched exactly),
free rows of a mixed batch get the tokens they get alone, the overlapped loop equals the
synchronous one, `length` leaves a valid prefix, bad specs are ValueErrors naming the field,
and no page leaks. The device mask itself is checked against llguidance's numpy reference."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import llguidance
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.runtime.sampling import apply_token_mask
from tokenspeed_jax.structured.spec import compile_spec

SMALL = dict(
    num_pages=120,
    page_size=8,
    max_batch_requests=6,
    max_scheduled_tokens=64,
    max_context_len=320,
    debug_checks=True,
)

SCHEMAS = [
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age"],
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
        },
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["tags", "kind"],
        "properties": {
            "tags": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {"enum": ["red", "green", "blue"]},
            },
            "kind": {"enum": ["a", "b"]},
        },
    },
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["point", "ok"],
        "properties": {
            "point": {
                "type": "object",
                "additionalProperties": False,
                "required": ["x", "y"],
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "boolean"},
                },
            },
            "ok": {"type": "boolean"},
        },
    },
]
PROMPTS = ["Give me JSON:", "tags please", "a point"]


@pytest.fixture(scope="module")
def sync_llm():
    return LLM("tiny-random", **SMALL)


@pytest.fixture(scope="module")
def async_llm():
    return LLM("tiny-random", async_scheduling=True, **SMALL)


def _free_pages(llm) -> tuple[int, int]:
    st = llm.engines[0].scheduler.stats()
    return st["free_pages"] + st.get("evictable_pages", 0), st["total_pages"]


def test_apply_token_mask_matches_llguidance_reference():
    rng = np.random.default_rng(0)
    for v in (37, 64, 260):
        words = rng.integers(-(2**31), 2**31, size=(3, (v + 31) // 32), dtype=np.int64)
        words = words.astype(np.int32)
        words[1] = -1  # an unconstrained row
        logits = rng.normal(size=(3, v)).astype(np.float32)
        want = logits.copy()
        apply_token_bitmask_inplace(want, words)
        got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(words)))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"json": "{not json"}, "structured_outputs.json"),
        (
            {"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
            "structured_outputs.json",
        ),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": "yes"}, "structured_outputs.choice"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({}, "exactly one"),
        ({"xml": "<a/>"}, "unknown kind"),
    ],
)
def test_bad_specs_name_the_field(spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams(structured_outputs=spec)


def test_json_schemas_validate_greedy_and_sampled(sync_llm):
    params = [SamplingParams(max_tokens=120, structured_outputs={"json": s}) for s in SCHEMAS]
    params += [
        SamplingParams(max_tokens=120, temperature=1.0, seed=7 + i, structured_outputs={"json": s})
        for i, s in enumerate(SCHEMAS)
    ]
    outs = sync_llm.generate(PROMPTS * 2, params)
    for out, p in zip(outs, params, strict=True):
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        doc = json.loads(out.text)
        jsonschema.validate(doc, p.structured_outputs["json"])
        assert out.token_ids[-1] != sync_llm.tokenizer.eos_token_id  # ended by the grammar


def test_regex_choice_grammar_and_json_object(sync_llm):
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    specs = [
        {"regex": r"[a-c]{3}-[0-9]{2}"},
        {"choice": ["yes", "no", "maybe so"]},
        {"grammar": lark},
        {"json_object": True},
    ]
    params = [
        SamplingParams(max_tokens=150, temperature=t, seed=1, structured_outputs=s)
        for s in specs
        for t in (0.0, 1.0)
    ]
    outs = sync_llm.generate(["x"] * len(params), params)
    for out, p in zip(outs, params, strict=True):
        spec = p.structured_outputs
        if "regex" in spec:
            assert re.fullmatch(spec["regex"], out.text), out.text
        elif "choice" in spec:
            assert out.text in spec["choice"]
        elif "grammar" in spec:
            assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", out.text), out.text
        else:
            assert out.finish_reason in ("stop", "length")
            if out.finish_reason == "stop":
                assert isinstance(json.loads(out.text), dict)
        if "json_object" not in spec:
            assert out.finish_reason == "stop"


def test_free_rows_are_untouched_by_constrained_neighbours(sync_llm):
    free = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=1.0, seed=5)]
    alone = sync_llm.generate(["free one", "free two"], free)
    mixed = sync_llm.generate(
        ["free one", "x", "free two", "y"],
        [
            free[0],
            SamplingParams(max_tokens=40, structured_outputs={"json": SCHEMAS[0]}),
            free[1],
            SamplingParams(max_tokens=40, structured_outputs={"choice": ["a", "b"]}),
        ],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == [a.token_ids for a in alone]


def test_async_loop_equals_sync_loop(sync_llm, async_llm):
    params = [
        SamplingParams(max_tokens=100, temperature=1.0, seed=11 + i, structured_outputs={"json": s})
        for i, s in enumerate(SCHEMAS)
    ]
    params += [
        SamplingParams(max_tokens=30, temperature=1.0, seed=3),
        SamplingParams(max_tokens=60, structured_outputs={"regex": "[xyz]{2,9}!"}),
    ]
    prompts = [*PROMPTS, "free", "regex"]
    a = sync_llm.generate(prompts, params)
    b = async_llm.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


def test_length_leaves_a_valid_prefix(sync_llm):
    p = SamplingParams(max_tokens=5, structured_outputs={"json": SCHEMAS[1]})
    out = sync_llm.generate(["cut"], p)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    engine = sync_llm.engines[0]
    matcher = llguidance.LLMatcher(engine._book().tokenizer(), p.grammar)
    assert matcher.try_consume_tokens(out.token_ids) == 5


def test_bad_request_then_serving_continues_without_leaks(sync_llm):
    free0, total = _free_pages(sync_llm)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        sync_llm.generate(
            ["a", "b"], [SamplingParams(max_tokens=4), SamplingParams(structured_outputs={"regex": "("})]
        )
    outs = sync_llm.generate(["a"], SamplingParams(max_tokens=8, structured_outputs={"choice": ["ok"]}))
    assert outs[0].text == "ok" and outs[0].finish_reason == "stop"
    assert _free_pages(sync_llm) == (free0, total)
    assert len(sync_llm.engines[0]._book()) == 0  # every matcher dropped


def test_retraction_keeps_constraints_exact(sync_llm):
    # few pages: constrained requests are retracted and resumed; outputs still validate and
    # equal a roomy engine's (greedy)
    tight = LLM("tiny-random", **{**SMALL, "num_pages": 72})
    params = [SamplingParams(max_tokens=90, structured_outputs={"json": SCHEMAS[i % 3]}) for i in range(6)]
    prompts = [f"prompt number {i} " * 3 for i in range(6)]
    outs = tight.generate(prompts, params)
    assert tight.engines[0].scheduler.stats()["num_retractions"] > 0
    for out, p in zip(outs, params, strict=True):
        jsonschema.validate(json.loads(out.text), p.structured_outputs["json"])
    roomy_outs = sync_llm.generate(prompts, params)  # the same config, with room
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy_outs]


def test_constraints_add_no_compiles(sync_llm):
    engine = sync_llm.engines[0]
    sync_llm.generate(["warm"], SamplingParams(max_tokens=4))
    before = engine.runner.num_compiles
    sync_llm.generate(
        ["x", "y"],
        [
            SamplingParams(max_tokens=20, structured_outputs={"json_object": True}),
            SamplingParams(max_tokens=20),
        ],
    )
    sync_llm.generate(["warm"], SamplingParams(max_tokens=4))
    assert engine.runner.num_compiles == before
    assert compile_spec({"choice": ["a"]})  # the compiled grammar is a non-empty string
