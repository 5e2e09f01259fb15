"""A fuzz of request bodies (hypothesis) against the in-process app on the tiny model: OpenAI
completions / chat schemas filled with random values (unicode with lone surrogates, NaN / inf,
nested nulls, huge n, huge logit_bias maps, stop lists of thousands, junk of any JSON type), JSON
that is not an object, and random bytes. Every answer is a 200 or a 4xx; every 4xx carries an
OpenAI error body (message, type, param, code); a good request is answered after each example;
no page is held at the end.

Bounded for CI: few examples per schema, tiny outputs (max_tokens <= 8 whenever it is valid), one
engine shared by the module (test_openai.py's configuration: its compiled shapes are read back).
`hypothesis.event` records each answer's status and param (`--hypothesis-show-statistics`).
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tokenspeed_jax import LLM  # noqa: E402
from tokenspeed_jax.server.app import build_app  # noqa: E402

CTX = 256
# more for a local bug hunt: TOKENSPEED_FUZZ_EXAMPLES=2000 pytest tests/.../test_server_fuzz.py
EXAMPLES = int(os.environ.get("TOKENSPEED_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def client():
    llm = LLM(
        "tiny-random",
        num_pages=300,
        page_size=8,
        max_batch_requests=8,
        max_scheduled_tokens=32,
        max_context_len=CTX,
    )
    with TestClient(build_app(llm)) as c:
        for _ in range(9000):  # warm-up (compiled shapes read back, or compiled: <= 15 min)
            if c.get("/health").status_code == 200:
                break
            time.sleep(0.1)
        yield c
        st_ = c.get("/stats").json()
        assert st_["free_pages"] == st_["total_pages"] and st_["num_running"] == 0, st_


# ---------------------------------------------------------------------------- strategies
GOOD_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
# any text, lone surrogates included (JSON carries them as \ud800 escapes)
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
NUMBER = st.one_of(
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2, 1e308, -0.0, 2**63, 2**64 + 1]),
)
JUNK = st.recursive(
    st.none() | st.booleans() | NUMBER | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)


def _field(good: st.SearchStrategy, bad: st.SearchStrategy | None = None) -> st.SearchStrategy:
    """16 in 20 a good value, 2 a bad value of the field's own kind, the rest junk of any JSON
    type (a null included)."""

    def pick(k: int) -> st.SearchStrategy:
        if k < 16:
            return good
        return bad if k < 18 and bad is not None else JUNK

    return st.integers(0, 19).flatmap(pick)


# thousands of stop strings / logit_bias entries, cheap to draw (no per-entry choices)
MANY_STOPS = st.integers(1000, 3000).map(lambda n: [f"s{i}" for i in range(n)])
HUGE_BIAS = st.integers(300, 5000).map(lambda n: {str(7 * i): 1.0 for i in range(n)})
VOCAB = st.integers(0, 259)
SMALL_MAX = st.integers(1, 8)
BAD_MAX = st.sampled_from([0, -5, CTX, 10**12, None, 3.5, "4", True])
COMMON = {
    "model": _field(st.just("tiny-random"), st.sampled_from(["gpt-4", ""])),
    "temperature": _field(st.floats(0, 2), NUMBER),
    "top_p": _field(st.floats(0.01, 1), NUMBER),
    "top_k": _field(st.sampled_from([-1, 1, 5, 10**9]), st.sampled_from([0, -2, 1.5])),
    "n": _field(st.sampled_from([1, 2, 3]), st.sampled_from([64, 65, 0, -1, 10**9])),
    "seed": _field(st.integers(0, 2**32), st.integers(-(2**70), 2**70)),
    "stop": _field(
        st.one_of(GOOD_TEXT, st.lists(GOOD_TEXT, max_size=4), MANY_STOPS),
        st.one_of(TEXT, st.lists(st.one_of(st.none(), TEXT), max_size=3)),
    ),
    "stop_token_ids": _field(st.lists(VOCAB, max_size=4), st.lists(NUMBER, max_size=3)),
    "ignore_eos": _field(st.booleans()),
    "stream": _field(st.booleans()),
    "stream_options": _field(
        st.one_of(st.none(), st.fixed_dictionaries({}, optional={"include_usage": _field(st.booleans())}))
    ),
    "presence_penalty": _field(st.floats(-2, 2), NUMBER),
    "frequency_penalty": _field(st.floats(-2, 2), NUMBER),
    "repetition_penalty": _field(st.floats(0.5, 2), NUMBER),
    "logit_bias": _field(
        st.dictionaries(VOCAB.map(str), st.floats(-100, 100), max_size=4),
        st.one_of(HUGE_BIAS, st.dictionaries(TEXT, NUMBER, max_size=3)),
    ),
    "user": _field(GOOD_TEXT, TEXT),
    "response_format": _field(
        st.one_of(st.none(), st.just({"type": "text"}), st.just({"type": "json_object"})),
        st.one_of(
            st.fixed_dictionaries({"type": TEXT}, optional={"json_schema": JUNK}),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": JUNK}),
                }
            ),
        ),
    ),
    # vLLM's structured-output fields: mostly absent (null), else random patterns / lists
    "guided_regex": _field(st.none(), TEXT),
    "guided_choice": _field(st.none(), st.lists(TEXT, max_size=3)),
    "guided_json": _field(st.none(), JUNK),
}
MESSAGE = st.fixed_dictionaries(
    {
        "role": _field(
            st.sampled_from(["system", "user", "assistant"]), st.sampled_from(["tool", "developer", "x", ""])
        ),
        "content": _field(
            st.one_of(
                GOOD_TEXT,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": GOOD_TEXT}), max_size=2),
            ),
            st.one_of(
                TEXT, st.none(), st.lists(st.fixed_dictionaries({"type": TEXT, "text": JUNK}), max_size=2)
            ),
        ),
    },
    optional={"name": _field(GOOD_TEXT, TEXT), "tool_calls": JUNK, "tool_call_id": _field(TEXT)},
)
COMPLETION = st.fixed_dictionaries(
    {
        "prompt": _field(
            st.one_of(
                GOOD_TEXT.filter(bool),
                st.lists(VOCAB, min_size=1, max_size=6),
                st.lists(GOOD_TEXT.filter(bool), min_size=1, max_size=1),
            ),
            st.one_of(
                TEXT,
                st.just(""),
                st.lists(st.integers(-2, 10**6), max_size=6),
                st.lists(TEXT, min_size=2, max_size=3),
            ),
        ),
        "max_tokens": st.one_of(SMALL_MAX, SMALL_MAX, BAD_MAX),
    },
    optional={
        **COMMON,
        "echo": _field(st.booleans()),
        "logprobs": _field(st.sampled_from([None, 0, 1, 5]), st.sampled_from([21, -1])),
        "best_of": _field(st.none(), st.sampled_from([1, 2])),
        "suffix": _field(st.none()),
    },
)
CHAT = st.fixed_dictionaries(
    {
        "messages": _field(st.lists(MESSAGE, min_size=1, max_size=3), st.lists(JUNK, max_size=2)),
        "max_completion_tokens": st.one_of(SMALL_MAX, SMALL_MAX, BAD_MAX),
    },
    optional={
        **COMMON,
        "logprobs": _field(st.booleans()),
        "top_logprobs": _field(st.sampled_from([None, 0, 2, 20]), st.sampled_from([21, -1])),
        "tools": _field(
            st.none(),
            st.one_of(
                st.lists(JUNK, max_size=2),
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.just("function"),
                            "function": st.fixed_dictionaries({"name": TEXT, "parameters": JUNK}),
                        }
                    ),
                    min_size=1,
                    max_size=2,
                ),
            ),
        ),
        "tool_choice": _field(st.sampled_from(["auto", "none"]), st.just("required")),
        "parallel_tool_calls": _field(st.booleans()),
    },
)


# ---------------------------------------------------------------------------- checks
def _send(client, path: str, content: bytes) -> None:
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    hypothesis.event(f"{r.status_code} {r.json()['error']['param'] if r.status_code >= 400 else ''}")
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and err["type"] and "param" in err, err
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        for data in events[:-1]:
            assert "error" not in json.loads(data), data  # no stream failed after its 200
    elif path.startswith("/v1/"):
        assert r.json()["choices"], r.text[:300]
    good = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1})
    assert good.status_code == 200, good.text


def _encode(body) -> bytes:
    # NaN / Infinity as Python's json writes them (not strict JSON, but what clients send)
    return json.dumps(body, allow_nan=True).encode()


@FUZZ
@given(body=COMPLETION)
def test_fuzz_completions(client, body):
    _send(client, "/v1/completions", _encode(body))


@FUZZ
@given(body=CHAT)
def test_fuzz_chat(client, body):
    _send(client, "/v1/chat/completions", _encode(body))


@settings(FUZZ, max_examples=max(EXAMPLES // 3, 1))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
    content=st.one_of(
        st.binary(max_size=64), JUNK.map(_encode), TEXT.map(lambda t: t.encode("utf-8", "surrogatepass"))
    ),
)
def test_fuzz_raw_bodies(client, path, content):
    _send(client, path, content)


def test_floats_are_finite_or_refused(client):
    """NaN / inf in every number field the schema reads: 400 naming it, never a 500."""
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for value in (math.nan, math.inf, -math.inf):
            r = client.post(
                "/v1/completions",
                content=_encode({"prompt": "x", "max_tokens": 1, field: value}),
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
