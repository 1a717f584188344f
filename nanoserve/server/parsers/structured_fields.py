"""The body's structured-output fields to one `StructuredOutputs`, or a 400 naming the field.

Owns the forms clients send: OpenAI's `response_format` (`text`, `json_object`, `json_schema`
with name, schema and strict), vLLM's `structured_outputs` object (json, regex, choice,
grammar, json_object) and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. At most one of them may constrain a request. The spec carries the field it
came from, so a schema the grammar library refuses later is a 400 naming that field.
Refuses: compiling anything (`nanoserve.engine.structured` does, at admission) and tool calling
(`tools` builds its own spec).
"""

from __future__ import annotations

from typing import Any

from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import STRUCTURED_KINDS, StructuredOutputs
from nanoserve.server.errors import bad_request

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def structured_outputs(body: Any) -> StructuredOutputs | None:
    """The one structured-output spec the body asks for; None when it asks for none."""
    specs = [(name, build) for name, build in _FORMS.items() if getattr(body, name, None) is not None]
    built = [(name, spec) for name, build in specs if (spec := build(getattr(body, name))) is not None]
    if len(built) > 1:
        names = [name for name, _ in built]
        raise bad_request(f"give at most one of {', '.join(names)}: each constrains the output",
                          names[1])
    return built[0][1] if built else None


def _spec(param: str, *, whole_field: bool = False, **fields: Any) -> StructuredOutputs:
    """`whole_field`: the field is the spec itself (guided_regex), so a refusal names it alone."""
    try:
        return StructuredOutputs(**fields, param=param)
    except InvalidRequestError as error:
        raise bad_request(error.message, param if whole_field else error.param or param) from None


def _response_format(value: dict[str, Any]) -> StructuredOutputs | None:
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; "
                          f"got {kind!r}", "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("response_format", json_object=True)
    json_schema = value.get("json_schema")
    if not isinstance(json_schema, dict):
        raise bad_request("response_format of type json_schema needs a json_schema object "
                          "(name, schema, strict)", "response_format.json_schema")
    name, strict = json_schema.get("name"), json_schema.get("strict")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name must be a non-empty string",
                          "response_format.json_schema.name")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be true, false or absent",
                          "response_format.json_schema.strict")
    schema = json_schema.get("schema", {"type": "object"})  # OpenAI: absent means any object
    return _spec("response_format.json_schema.schema", json=schema)


def _structured_object(value: dict[str, Any]) -> StructuredOutputs:
    unknown = sorted(set(value) - set(STRUCTURED_KINDS))
    if unknown:
        raise bad_request(f"structured_outputs has no field {unknown[0]!r} here; it takes one of "
                          f"{', '.join(STRUCTURED_KINDS)}", f"structured_outputs.{unknown[0]}")
    fields = {key: item for key, item in value.items() if item is not None}
    if isinstance(fields.get("choice"), list):
        fields["choice"] = tuple(fields["choice"])
    return _spec("structured_outputs", **fields)


def _guided(name: str):
    kind = GUIDED_FIELDS[name]

    def build(value: Any) -> StructuredOutputs:
        return _spec(name, whole_field=True, **{kind: tuple(value) if kind == "choice" else value})

    return build


_FORMS = {"response_format": _response_format, "structured_outputs": _structured_object,
          **{name: _guided(name) for name in GUIDED_FIELDS}}
