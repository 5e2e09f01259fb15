"""Structured outputs and forced tool calls through the real server (uvicorn, localhost) on the
tiny random model, driven by the official `openai` client.

A random model writes whatever the grammar lets it: every string in a schema here has a
`maxLength` (or the model writes one string until max_tokens), and max_tokens leaves room for the
longest output a schema allows. Each assertion holds for any model output under the constraint.
"""

from __future__ import annotations

import json
import re
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tests.tokenspeed_jax.server.live import LiveServer  # noqa: E402
from tokenspeed_jax import LLM  # noqa: E402
from tokenspeed_jax.server.app import build_app  # noqa: E402
from tokenspeed_jax.server.tools import render_prompt  # noqa: E402

CTX = 2048  # byte tokens: the tools' system prompt alone is ~700
MAX = 300  # tokens: the longest reply the schemas below allow, with room to spare

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "zip"],
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
        },
        "ok": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 4},
    },
    "required": ["name", "age", "tags", "address", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
}
ADD = {
    "type": "object",
    "additionalProperties": False,
    "required": ["a", "b"],
    "properties": {
        "a": {"type": "integer", "minimum": -50, "maximum": 50},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
PARAMS = {"get_weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "Weather in Oslo, and 2 + 3?"}]


@pytest.fixture(scope="module")
def srv():
    llm = LLM(
        "tiny-random",
        num_pages=1200,
        page_size=8,
        max_batch_requests=8,
        max_scheduled_tokens=32,
        max_context_len=CTX,
        min_kv_bucket=CTX,
    )  # 2 shape keys
    server = LiveServer(build_app(llm))
    server.wait_ready(900)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield types.SimpleNamespace(url=server.url, llm=llm, client=client, tok=llm.tokenizer)
    server.stop()


def _sampling(mode: str) -> dict:
    """Greedy, or three seeded samples at temperature 1."""
    return dict(temperature=0) if mode == "greedy" else dict(temperature=1.0, seed=11, n=3)


def _all_pages_free(srv) -> bool:
    st = httpx.get(f"{srv.url}/stats").json()
    return st["free_pages"] == st["total_pages"]


# ---------------------------------------------------------------------------- structured outputs
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_json_schema_outputs_validate(srv, mode):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = srv.client.chat.completions.create(
        model="tiny-random", messages=MSGS, max_tokens=MAX, response_format=fmt, **_sampling(mode)
    )
    done = srv.client.completions.create(
        model="tiny-random",
        prompt="Person: ",
        max_tokens=MAX,
        extra_body={"guided_json": SCHEMA},
        **_sampling(mode),
    )
    texts = [c.message.content for c in chat.choices] + [c.text for c in done.choices]
    assert len(texts) == (2 if mode == "greedy" else 6)
    for c in [*chat.choices, *done.choices]:
        assert c.finish_reason == "stop"  # the grammar completed, well before max_tokens
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text.startswith('{"name": ')  # compact: ", " and ": " only
    if mode == "sampled":
        assert len(set(texts[:3])) > 1  # seeded samples differ


def test_json_object_regex_choice_and_grammar(srv):
    kw = dict(model="tiny-random", max_tokens=60, temperature=1.0, seed=3, n=3)
    obj = srv.client.chat.completions.create(
        messages=MSGS,
        response_format={"type": "json_object"},
        **{**kw, "max_tokens": MAX, "temperature": 0, "n": 1},
    )
    # any JSON object: a random model may nest deeply; a complete one must parse
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")
    pattern = r"(cat|dog)-[0-9]{2,4}"
    rx = srv.client.completions.create(prompt="id: ", extra_body={"guided_regex": pattern}, **kw)
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in rx.choices)
    options = ["alpha", "beta", "gamma delta"]
    ch = srv.client.chat.completions.create(messages=MSGS, extra_body={"guided_choice": options}, **kw)
    assert all(c.message.content in options for c in ch.choices)
    grammar = 'start: ("yes" | "no") " " NUM\nNUM: /[1-9][0-9]?/'
    gr = srv.client.completions.create(
        prompt="q: ", extra_body={"structured_outputs": {"grammar": grammar}}, **kw
    )
    assert all(re.fullmatch(r"(yes|no) [1-9][0-9]?", c.text) for c in gr.choices)
    assert _all_pages_free(srv)


@pytest.mark.parametrize("chat", [True, False])
def test_streaming_equals_non_streaming(srv, chat):
    kw = dict(
        model="tiny-random",
        max_tokens=MAX,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    if chat:
        whole = srv.client.chat.completions.create(messages=MSGS, **kw).choices[0]
        chunks = list(srv.client.chat.completions.create(messages=MSGS, stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        want = whole.message.content
    else:
        kw["extra_body"] = {"response_format": kw.pop("response_format")}
        whole = srv.client.completions.create(prompt="Person: ", **kw).choices[0]
        chunks = list(srv.client.completions.create(prompt="Person: ", stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        want = whole.text
    assert text == want and chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


# ---------------------------------------------------------------------------- tool calls
def _check_calls(calls, names=None) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_named_tool_choice_is_forced(srv, mode):
    r = srv.client.chat.completions.create(
        model="tiny-random",
        messages=MSGS,
        tools=TOOLS,
        max_tokens=MAX,
        tool_choice={"type": "function", "function": {"name": "add"}},
        **_sampling(mode),
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls, {"add"})


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_required_tool_choice_is_forced(srv, mode, parallel):
    r = srv.client.chat.completions.create(
        model="tiny-random",
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX,
        parallel_tool_calls=parallel,
        **_sampling(mode),
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        _check_calls(c.message.tool_calls, set(PARAMS))
        if not parallel:
            assert len(c.message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_equal_non_streaming(srv, choice):
    kw = dict(
        model="tiny-random", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=MAX, temperature=0
    )
    whole = srv.client.chat.completions.create(**kw).choices[0]
    chunks = list(srv.client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == list(range(len(whole.message.tool_calls)))
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]
    assert all(d.id.startswith("call_") and d.type == "function" for d in deltas)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"


def test_auto_renders_the_tools_and_the_history(srv):
    """Under auto the model writes freely (a random one writes no call: plain content); the
    prompt is the tools' system message plus the history's calls and results."""
    history = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    r = srv.client.chat.completions.create(
        model="tiny-random",
        messages=history,
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ids = render_prompt(srv.tok, history, TOOLS)
    text = srv.tok.decode(ids)
    assert "<tools>" in text and '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(ids)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None
    plain = srv.client.completions.create(
        model="tiny-random", prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.message.content == plain.choices[0].text  # no call in it: passed through as is
    none = srv.client.chat.completions.create(
        model="tiny-random", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert none.usage.prompt_tokens == len(render_prompt(srv.tok, MSGS, None))  # not rendered


# ---------------------------------------------------------------------------- bad input
BAD_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer", "minimum": "low"}}},
    },
}


@pytest.mark.parametrize(
    "route,extra,param",
    [
        (
            "chat",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            },
            "response_format",
        ),
        ("chat", {"response_format": {"type": "xml"}}, "response_format"),
        ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("completions", {"guided_json": "{oops"}, "guided_json"),
        ("completions", {"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ("completions", {"guided_choice": []}, "guided_choice"),
        ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ("completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
        (
            "chat",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tools": [{"type": "retrieval"}]}, "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
        ("chat", {"tools": [BAD_TOOL]}, "tools"),
        ("chat", {"tools": TOOLS, "guided_regex": "a+"}, "guided_regex"),
        ("chat", {"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
        ("completions", {"tools": TOOLS}, "tools"),  # chat only: an unknown field here
    ],
)
def test_bad_inputs_are_400_naming_the_field(srv, route, extra, param):
    if route == "chat":
        body = {"messages": MSGS, "max_tokens": 4, **extra}
    else:
        body = {"prompt": "x", "max_tokens": 4, **extra}
    r = httpx.post(f"{srv.url}/v1/{'chat/' if route == 'chat' else ''}completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert err["type"] == "invalid_request_error"
    # the server keeps serving, and nothing leaked
    ok = srv.client.completions.create(
        model="tiny-random", prompt="x", max_tokens=2, extra_body={"guided_regex": "[ab]{2}"}
    )
    assert re.fullmatch("[ab]{2}", ok.choices[0].text)
    assert _all_pages_free(srv)


def test_tool_choice_none_combines_with_a_constraint(srv):
    r = srv.client.chat.completions.create(
        model="tiny-random",
        messages=MSGS,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=20,
        extra_body={"guided_choice": ["x", "y"]},
    )
    assert r.choices[0].message.content in ("x", "y") and r.choices[0].message.tool_calls is None
