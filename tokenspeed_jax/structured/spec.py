"""`SamplingParams.structured_outputs` -> one llguidance grammar string, checked up front.

The dict holds exactly one constraint, spelled as vLLM's `StructuredOutputsParams`:
  {"json": schema (a dict or its JSON text)}   output is JSON valid under the schema;
  {"json_object": True}                         output is any JSON object;
  {"regex": pattern}                            output matches the whole regex (Rust syntax);
  {"choice": [str, ...]}                        output is exactly one of the strings;
  {"grammar": text}                             a Lark grammar (llguidance dialect) or a GBNF one.
JSON is compact by default: ", " between items, ": " after keys, no other whitespace. Free
whitespace lets a model pad forever (a small or random one does, until `length`); a schema may
opt back in with `"x-guidance": {"whitespace_flexible": true}`.
Errors are ValueErrors naming `structured_outputs.<kind>` and what the compiler said.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a core dependency
        raise ValueError("structured outputs need llguidance (pip install llguidance)") from e
    return llguidance


def _grammar(kind: str, value: Any) -> str:
    llg = _llg()
    m = llg.LLMatcher
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r:.80}")
        return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (an object), got {type(value).__name__}"
            )
        return m.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {value!r:.80}")
        return m.grammar_from_regex(value)
    if kind == "choice":
        if (
            isinstance(value, str)
            or not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r:.80}"
            )
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got {value!r:.80}")
        try:
            return llg.grammar_from("grammar", value)  # Lark as is; GBNF converted to Lark
        except ValueError as e:
            raise ValueError(f"structured_outputs.grammar: {e}") from None
    raise ValueError(f"structured_outputs: unknown kind {kind!r} (one of {', '.join(KINDS)})")


def compile_spec(spec: Mapping[str, Any]) -> str:
    """The llguidance grammar of one `structured_outputs` dict; ValueError naming the field when
    the dict is malformed or the compiler refuses the schema / regex / grammar."""
    if not isinstance(spec, Mapping):
        raise ValueError(
            f"structured_outputs must be a dict with one of {', '.join(KINDS)}, got {type(spec).__name__}"
        )
    kinds = [k for k, v in spec.items() if v is not None and v is not False]
    if len(kinds) != 1:
        raise ValueError(
            f"structured_outputs must set exactly one of {', '.join(KINDS)}, got "
            f"{sorted(spec) if kinds else 'none'}"
        )
    kind, value = kinds[0], spec[kinds[0]]
    # the same constraint again (n samples, a schema every request repeats) is cached by its JSON
    # text; other values (tuples, sets, ...) compile, or are refused, as given
    if type(value) in (dict, list, str, bool):
        try:
            return _compile_text(kind, json.dumps(value))  # key order matters: kept
        except TypeError:  # not JSON inside (keys of mixed types, objects)
            pass
    return _compile(kind, value)


@functools.lru_cache(maxsize=256)
def _compile_text(kind: str, text: str) -> str:
    return _compile(kind, json.loads(text))


def _compile(kind: str, value: Any) -> str:
    try:
        grammar = _grammar(kind, value)
    except ValueError as e:
        msg = str(e)
        raise ValueError(
            msg if msg.startswith("structured_outputs") else f"structured_outputs.{kind}: {msg}"
        ) from None
    error = _llg().LLMatcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(f"structured_outputs.{kind} is invalid: {error.strip()}")
    return grammar
