"""Function tools on the chat route: checking `tools` / `tool_choice`, rendering them into the
prompt, and the output constraint `tool_choice` implies. Parsing the reply: `tool_parse`.

tool_choice semantics (OpenAI's, enforced the way vLLM does):
  "none"      the tools are not rendered (the model cannot see them) and the reply is never
              parsed; history messages with tool calls / results still render. (vLLM renders
              them and ignores calls; not rendering them keeps the model from writing calls
              that would then come back as text.)
  "auto"      (the default when tools are given) the model writes freely; `<tool_call>` blocks
              (or a bare JSON call as the whole reply) are parsed into `tool_calls`.
  "required"  the reply is constrained to a JSON array of 1+ {"name", "parameters"} objects, one
              per call (at most one when parallel_tool_calls is false).
  {"type": "function", "function": {"name": f}}  the reply is constrained to f's parameters
              schema; the whole reply is the call's arguments.

Rendering: a chat template that mentions `tools` gets them as the `tools=` variable (and the
history's calls with their arguments as objects, as Hugging Face templates expect). A template
that does not (SmolLM2's, the byte model's plain fallback) gets a Hermes / Qwen style system
message listing the tools as JSON in <tools></tools> (appended to the first system message if
there is one), assistant calls written as <tool_call>{...}</tool_call> and tool results as a user
turn of <tool_response>...</tool_response> blocks.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenspeed_jax.engine.chat_template import render_chat
from tokenspeed_jax.server.errors import UnsupportedField
from tokenspeed_jax.structured.spec import compile_spec

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """A chat request's checked tools and what tool_choice makes of them.

    mode: "none", "auto", "required" or "named" (then `named` is the function). params: each
    function's parameters schema. tools: the tool dicts to render (parameters filled in)."""

    tools: list[dict[str, Any]]
    mode: str
    params: dict[str, dict[str, Any]]
    named: str | None = None
    parallel: bool = True

    @property
    def rendered(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows (none for tool_choice "none")."""
        return self.tools if self.mode != "none" and self.tools else None

    @property
    def parses(self) -> bool:
        """Whether replies are parsed into tool calls."""
        return self.mode != "none"

    @property
    def forces(self) -> bool:
        """Whether tool_choice constrains the output (required / named)."""
        return self.mode in ("required", "named")

    def constraint(self) -> tuple[dict[str, Any] | None, str | None]:
        """(structured_outputs, request field) that tool_choice implies."""
        if self.mode == "named":
            assert self.named is not None
            return {"json": self.params[self.named]}, "tool_choice"
        if self.mode == "required":
            return {"json": required_schema(self.params, self.parallel)}, "tools"
        return None, None


def required_schema(params: Mapping[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of {"name", "parameters"} calls."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": p},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, p in params.items()
            ]
        },
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    """One tool, normalized ({"type": "function", "function": {..., "parameters": schema}})."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise UnsupportedField("tools", f"{where} must be an object, got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise UnsupportedField(
            "tools",
            f"{where}.type must be 'function' (the only tool type "
            f"this server runs), got {tool.get('type')!r:.60}",
        )
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise UnsupportedField("tools", f"{where}.function must be an object with a 'name'")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise UnsupportedField(
            "tools", f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r:.80}"
        )
    params = fn.get("parameters")
    if params is None:  # OpenAI: omitted = a function without parameters
        params = EMPTY_PARAMETERS
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise UnsupportedField(
            "tools", f"{where}.function.parameters must be a JSON schema of an object, got {params!r:.80}"
        )
    try:
        compile_spec({"json": params})
    except ValueError as e:
        raise UnsupportedField("tools", f"{where}.function.parameters: {e}") from None
    return {**tool, "function": {**fn, "parameters": params}}


def _choice(tool_choice: Any, names: Sequence[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise UnsupportedField(
                "tool_choice",
                f"tool_choice must be 'none', 'auto', 'required' "
                f"or a named function, got {tool_choice!r:.60}",
            )
        if tool_choice == "required" and not names:
            raise UnsupportedField("tool_choice", "tool_choice 'required' needs tools")
        return tool_choice, None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise UnsupportedField(
            "tool_choice", 'tool_choice must be {"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise UnsupportedField(
            "tool_choice", f"tool_choice names function {name!r:.80}, which is not in tools"
        )
    return "named", name


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    constrained: str | None = None,
) -> ToolPlan | None:
    """The checked plan of a chat request's tool fields; None when it has no tools to offer or
    parse. constrained: the request field that already constrains the output (response_format,
    guided_*), which cannot be combined with tools. UnsupportedField (HTTP 400) on bad input."""
    checked = [_check_tool(i, t) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in checked]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise UnsupportedField("tools", f"tools has duplicate function names: {sorted(dup)}")
    mode, named = _choice(tool_choice, names)
    if not checked and mode in ("none", "auto"):
        return None
    if constrained is not None and mode != "none":
        raise UnsupportedField(
            constrained, f"{constrained} cannot be combined with tools (use tool_choice 'none', or drop one)"
        )
    return ToolPlan(
        tools=checked,
        mode=mode,
        named=named,
        params={t["function"]["name"]: t["function"]["parameters"] for t in checked},
        parallel=parallel_tool_calls is not False,
    )


# ---------------------------------------------------------------------------- rendering
def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes / Qwen 2.5 tool instructions, for templates that do not render tools."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _arguments(call: Mapping[str, Any]) -> Any:
    """A history call's arguments as an object when they are JSON text (templates dump them)."""
    args = call["function"].get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def _with_object_arguments(m: Mapping[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return dict(m)
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def hermes_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` spelled for a template without tool support: plain role + content only."""
    out: list[dict[str, Any]] = []
    tool_turn = False  # the last message out is a user turn of tool responses
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if tool_turn:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            tool_turn = True
            continue
        tool_turn = False
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}, ensure_ascii=False)
                + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_prompt(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[int]:
    """Prompt ids of a chat request: `render_chat` unless tools or tool messages are involved,
    then the template's own tool rendering when it has one, else `hermes_messages`."""
    toolish = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not toolish:
        return render_chat(tokenizer, messages)
    template = getattr(tokenizer, "chat_template", None)
    if template is not None and "tools" in template:
        from jinja2.exceptions import TemplateError

        kwargs = {"tools": list(tools)} if tools else {}
        try:
            text = tokenizer.apply_chat_template(
                [_with_object_arguments(m) for m in messages], add_generation_prompt=True, **kwargs
            )
        except TemplateError as e:  # e.g. the template's raise_exception on a role order
            raise ValueError(f"the chat template refused these messages: {e}") from None
        return list(tokenizer.encode(text, add_special_tokens=False))
    return render_chat(tokenizer, hermes_messages(messages, tools))
