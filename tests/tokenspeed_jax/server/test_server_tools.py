"""Tool calling and output constraints of the server, without an engine: checking `tools` /
`tool_choice`, the prompt they render, parsing replies into tool calls (whole and streamed), and
mapping the constraint fields of a request to `structured_outputs`."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from tokenspeed_jax.engine.chat_template import render_chat  # noqa: E402
from tokenspeed_jax.models.byte_tokenizer import ByteTokenizer  # noqa: E402
from tokenspeed_jax.server.errors import UnsupportedField  # noqa: E402
from tokenspeed_jax.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from tokenspeed_jax.server.tool_parse import ToolOutput, parse_auto  # noqa: E402
from tokenspeed_jax.server.tools import (  # noqa: E402
    hermes_messages,
    plan_tools,
    render_prompt,
    required_schema,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]


def _plan(choice=None, parallel=None, tools=TOOLS):
    return plan_tools(tools, choice, parallel)


# ---------------------------------------------------------------------------- plan / checks
def test_plan_modes_and_constraints():
    assert plan_tools(None, None, None) is None and plan_tools([], "auto", None) is None
    auto = _plan()
    assert auto.mode == "auto" and auto.rendered == auto.tools and auto.constraint() == (None, None)
    assert auto.params["now"] == {"type": "object", "properties": {}}  # omitted = no parameters
    none = _plan("none")
    assert none.rendered is None and not none.parses
    named = _plan({"type": "function", "function": {"name": "weather"}})
    assert named.constraint() == ({"json": WEATHER}, "tool_choice")
    req = _plan("required", parallel=False)
    spec, field = req.constraint()
    assert field == "tools" and spec["json"] == required_schema(req.params, parallel=False)
    assert spec["json"]["maxItems"] == 1 and spec["json"]["minItems"] == 1
    assert "maxItems" not in _plan("required").constraint()[0]["json"]
    first = spec["json"]["items"]["anyOf"][0]
    assert first["properties"] == {"name": {"const": "weather"}, "parameters": WEATHER}
    assert first["additionalProperties"] is False


@pytest.mark.parametrize(
    "tools,choice,param,words",
    [
        ([{"type": "code_interpreter"}], None, "tools", "type must be 'function'"),
        ([{"type": "function", "function": {"description": "x"}}], None, "tools", "function.name"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools", "function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            None,
            "tools",
            "parameters must be a JSON schema",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            "tools",
            "of an object",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "bogus"}}},
                    },
                }
            ],
            None,
            "tools",
            "bogus",
        ),
        (TOOLS + TOOLS[:1], None, "tools", "duplicate"),
        (TOOLS, "sometimes", "tool_choice", "tool_choice must be"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope'"),
        (TOOLS, {"type": "function"}, "tool_choice", "tool_choice must be"),
        (None, "required", "tool_choice", "needs tools"),
        (None, {"type": "function", "function": {"name": "weather"}}, "tool_choice", "not in tools"),
    ],
)
def test_bad_tools_name_the_field(tools, choice, param, words):
    with pytest.raises(UnsupportedField) as e:
        plan_tools(tools, choice, None)
    assert e.value.field == param and words in str(e.value)


def test_tools_with_a_constraint_is_an_error_unless_tool_choice_none():
    with pytest.raises(UnsupportedField) as e:
        plan_tools(TOOLS, "auto", None, constrained="response_format")
    assert e.value.field == "response_format"
    assert plan_tools(TOOLS, "none", None, constrained="guided_regex").mode == "none"


# ---------------------------------------------------------------------------- constraints
def _body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize(
    "kw,want",
    [
        ({}, (None, None)),
        ({"response_format": {"type": "text"}}, (None, None)),
        ({"response_format": {"type": "json_object"}}, ({"json_object": True}, "response_format")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": WEATHER}}},
            ({"json": WEATHER}, "response_format"),
        ),
        ({"guided_json": WEATHER}, ({"json": WEATHER}, "guided_json")),
        ({"guided_regex": "a+"}, ({"regex": "a+"}, "guided_regex")),
        ({"guided_choice": ["x", "y"]}, ({"choice": ["x", "y"]}, "guided_choice")),
        ({"guided_grammar": 'start: "a"'}, ({"grammar": 'start: "a"'}, "guided_grammar")),
        ({"structured_outputs": {"regex": "b"}}, ({"regex": "b"}, "structured_outputs")),
    ],
)
def test_constraint_fields_map_to_structured_outputs(kw, want):
    assert _body(**kw).constraint() == want
    assert CompletionRequest(prompt="x", **kw).constraint() == want


@pytest.mark.parametrize(
    "kw,param,words",
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "guided_choice"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "structured_outputs",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
    ],
)
def test_bad_constraint_fields(kw, param, words):
    with pytest.raises(UnsupportedField) as e:
        _body(**kw).constraint()
    assert e.value.field == param and words in str(e.value)


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"guided_json": {"type": "bogus"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"minimum": "zero"}}},
                    },
                }
            },
            "response_format",
        ),
    ],
)
def test_compile_errors_are_reported_on_the_field_sent(kw, param):
    body = _body(**kw)
    with pytest.raises(UnsupportedField) as e:
        body.to_params(8, 0, body.constraint())
    assert e.value.field == param and param in str(e.value)
    assert "structured_outputs" in str(e.value)  # what the compiler said stays in the message


def test_to_params_carries_the_constraint():
    body = _body(guided_choice=["yes", "no"])
    p = body.to_params(8, 0, body.constraint())
    assert p.structured_outputs == {"choice": ["yes", "no"]} and p.grammar


def test_chat_messages_accept_tool_calls_and_results():
    body = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ]
    )
    msgs = [m.as_dict() for m in body.messages]
    assert msgs[1]["content"] == "" and msgs[1]["tool_calls"][0]["function"]["name"] == "weather"
    assert msgs[2] == {"role": "tool", "content": "rain", "tool_call_id": "call_1"}


# ---------------------------------------------------------------------------- rendering
def test_hermes_rendering_for_templates_without_tools():
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "rain", "tool_call_id": "c"},
        {"role": "tool", "content": "cold", "tool_call_id": "d"},
    ]
    out = hermes_messages(msgs, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("be brief\n\n# Tools") and "<tools>\n" in system
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(t) for t in listed] == TOOLS
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert out[3]["content"] == (
        "<tool_response>\nrain\n</tool_response>\n<tool_response>\ncold\n</tool_response>"
    )
    # no system message: one is added; no tools: none
    assert hermes_messages(msgs[1:2], TOOLS)[0]["role"] == "system"
    assert hermes_messages(msgs[1:2], None) == msgs[1:2]


def test_render_prompt_byte_fallback_and_template_with_tools():
    tok = ByteTokenizer()
    user = [{"role": "user", "content": "hi"}]
    assert render_prompt(tok, user, None) == render_chat(tok, user)
    text = tok.decode(render_prompt(tok, user, TOOLS))
    assert text.startswith("<|system|>\n# Tools") and '"name": "weather"' in text

    class Templated:  # a template that renders tools itself gets them (and object arguments)
        chat_template = "{% for t in tools %}{{ t.function.name }}{% endfor %}"
        seen: dict = {}

        def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
            self.seen = {"messages": messages, **kw}
            return "rendered"

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False  # the template writes BOS itself
            return [len(text)]

    t = Templated()
    history = [
        *user,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
        },
    ]
    assert render_prompt(t, history, TOOLS) == [len("rendered")]
    assert t.seen["tools"] == TOOLS and t.seen["messages"][1]["tool_calls"][0]["function"] == {
        "name": "now",
        "arguments": {},
    }

    class Refusing(Templated):
        def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
            from jinja2.exceptions import TemplateError

            raise TemplateError("roles must alternate")

    with pytest.raises(ValueError, match="roles must alternate"):  # a 400 on messages, not a 500
        render_prompt(Refusing(), history, TOOLS)


# ---------------------------------------------------------------------------- parsing
KNOWN = {"weather": WEATHER, "now": {}}


@pytest.mark.parametrize(
    "text,content,calls",
    [
        ("plain reply", "plain reply", []),
        (
            '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            None,
            [("weather", {"city": "Oslo"})],
        ),
        (
            'Let me check.\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "weather", "parameters": {"city": "Rome"}}</tool_call> done',
            "Let me check.\ndone",
            [("now", {}), ("weather", {"city": "Rome"})],
        ),
        ('<tool_call>{"name": "now", "arguments": "{}"}', None, [("now", {})]),  # unclosed, args text
        (' {"name": "weather", "arguments": {"city": "Oslo"}} ', None, [("weather", {"city": "Oslo"})]),
        (
            '[{"name": "now", "arguments": {}}, {"name": "now", "parameters": {}}]',
            None,
            [("now", {}), ("now", {})],
        ),
        ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', None, None),
        ('<tool_call>{"name": "now", "arguments": </tool_call>', None, None),
        ('{"name": "now"}', None, None),  # no arguments: not a call
        ('{"city": "Oslo"}', None, None),
    ],
)
def test_parse_auto(text, content, calls):
    got_content, got = parse_auto(text, KNOWN)
    if calls is None:  # unparseable: the reply is plain content
        assert (got_content, got) == (text, [])
        return
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
    assert len({c["id"] for c in got}) == len(got)


def _stream(plan, pieces: list[str], reason: str):
    out = ToolOutput(plan)
    deltas = [d for p in pieces for d in out.deltas(p, None)] + out.deltas("", reason)
    content = "".join(d.get("content", "") for d, _ in deltas)
    calls = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    reasons = [r for _, r in deltas if r is not None]
    assert reasons == [deltas[-1][1]] and deltas[-1][0] == {}  # last chunk: reason only
    return content, calls, deltas[-1][1]


@pytest.mark.parametrize(
    "text",
    [
        "Sure, here it is: a < b and c <tool and <tool_callx",
        "  Hi!  \n",
        'Checking.  \n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        '\n{"name": "now", "arguments": {}}',
        '{"city": 1} is not a call',
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>after',
        '<tool_call>{"broken"',
    ],
)
def test_streamed_auto_adds_up_to_the_whole_reply(text):
    plan = _plan()
    want_content, want_calls, want_reason = ToolOutput(plan).final(text, "stop")
    for size in (1, 3, len(text)):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        content, calls, reason = _stream(plan, pieces, "stop")
        assert content == (want_content or "") and reason == want_reason
        assert [c["function"] for c in calls] == [c["function"] for c in want_calls]
        assert [c["index"] for c in calls] == list(range(len(calls)))
    if "<tool_call>" in text or text.strip().startswith("{"):  # nothing of a call streamed early
        out = ToolOutput(plan)
        early = "".join(out.feed(p) for p in text)
        assert "<" not in early and "{" not in early


def test_streaming_holds_back_only_what_could_be_a_call():
    out = ToolOutput(_plan())
    assert out.feed("Hello") == "Hello"
    assert out.feed(" wor") == " wor"
    assert out.feed("ld <tool_") == "ld"  # " <tool_" may open a call
    assert out.feed("x>") == " <tool_x>"


def test_final_per_mode():
    named = ToolOutput(_plan({"type": "function", "function": {"name": "weather"}}))
    content, calls, reason = named.final('{"city": "Oslo"}', "stop")
    assert content is None and reason == "tool_calls"
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    _, calls, reason = named.final('{"city": "Os', "length")  # cut: still the call, reason kept
    assert calls[0]["function"]["arguments"] == '{"city": "Os' and reason == "length"
    req = ToolOutput(_plan("required"))
    content, calls, reason = req.final(
        '[{"name": "now", "parameters": {}}, {"name": "weather", "parameters": {"city": "x"}}]', "stop"
    )
    assert content is None and reason == "tool_calls" and len(calls) == 2
    assert req.final('[{"name": "now", "param', "length") == ('[{"name": "now", "param', [], "length")
    single = ToolOutput(_plan(parallel=False))
    _, calls, _ = single.final(
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
        "stop",
    )
    assert len(calls) == 1
    # a forced reply streams nothing until it ends, then its calls
    content, calls, reason = _stream(_plan("required"), ['[{"name": "now", ', '"parameters": {}}]'], "stop")
    assert content == "" and reason == "tool_calls" and calls[0]["function"]["name"] == "now"
