"""Request fields that constrain the output -> one `SamplingParams.structured_outputs` dict.

Spellings accepted (any one per request; two or more is a 400 naming them all, since silently
preferring one would hand the client output that ignores the other):
  response_format {"type": "text"}                        no constraint (OpenAI);
  response_format {"type": "json_object"}                 any JSON object (OpenAI);
  response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  (OpenAI);
  guided_json / guided_regex / guided_choice / guided_grammar                      (vLLM extras);
  structured_outputs {"json" | "json_object" | "regex" | "choice" | "grammar": ...}  (vLLM, as
    `SamplingParams.structured_outputs`).
The schema / regex / grammar itself is compiled by `SamplingParams` (llguidance); its ValueError
names `structured_outputs.<kind>` and is reported here under the field the client sent
(`field_error`).
"""

from __future__ import annotations

from typing import Any

from tokenspeed_jax.server.errors import UnsupportedField

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise UnsupportedField(
                "response_format", "response_format.json_schema must be an object with 'name' and 'schema'"
            )
        if "schema" not in spec:  # OpenAI makes it optional; an unconstrained "schema" is a guess
            raise UnsupportedField(
                "response_format", "response_format.json_schema.schema is required by this server"
            )
        return {"json": spec["schema"]}
    raise UnsupportedField(
        "response_format",
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r:.60}",
    )


def request_constraint(body: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(structured_outputs dict or None, the request field it came from) of `body`.
    UnsupportedField (HTTP 400) when two fields constrain at once or one is malformed."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    for name, kind in GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, {kind: value}))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        found.append(("structured_outputs", dict(so)))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise UnsupportedField(names[0], f"set at most one output constraint, got {', '.join(names)}")
    return (found[0][1], found[0][0]) if found else (None, None)


def field_error(field: str, error: ValueError) -> UnsupportedField:
    """SamplingParams' error about `structured_outputs.<kind>` as a 400 on the field sent."""
    msg = str(error)
    return UnsupportedField(field, msg if field == "structured_outputs" else f"{field}: {msg}")
