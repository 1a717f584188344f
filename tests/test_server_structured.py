"""Structured outputs and p_less through the HTTP API on the tiny model (random weights: only
the grammar makes an answer valid), with the official openai client where it has a helper."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from test_server_api import (
    MODEL,
    Served,
    assert_error,
    chunks_of,
    idle_client,
    serving,
    tiny_engine,
    wait_idle,
)

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6}, "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["city", "rank", "tags"], "additionalProperties": False}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    with serving(lambda: tiny_engine(tiny_model_dir)) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[httpx.Client]:
    with idle_client(served) as http:
        yield http


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_response_format_json_schema_validates(client: httpx.Client, temperature: float) -> None:
    reply = client.post("/v1/chat/completions", json={
        "messages": HI, "max_tokens": 60, "temperature": temperature, "seed": 3,
        "response_format": json_schema_format(SCHEMA)}).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_every_form_constrains_the_completions_endpoint(client: httpx.Client) -> None:
    forms = [{"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"regex": "[a-c]{4}"}},
             {"structured_outputs": {"choice": ["left", "right"]}}, {"guided_json": json.dumps(SCHEMA)},
             {"guided_regex": "[0-9]{2}x"}, {"guided_choice": ["up", "down"]},
             {"guided_grammar": 'start: "<" /[a-z]/ ">"'}, {"response_format": json_schema_format(SCHEMA)}]
    texts = [client.post("/v1/completions", json={"prompt": "x", "max_tokens": 60, "seed": 1, **form})
             .json()["choices"][0]["text"] for form in forms]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert len(texts[1]) == 4 and set(texts[1]) <= set("abc")
    assert texts[2] in ("left", "right")
    jsonschema.validate(json.loads(texts[3]), SCHEMA)
    assert texts[4][:2].isdigit() and texts[4][2:] == "x"
    assert texts[5] in ("up", "down")
    assert texts[6][0] == "<" and texts[6][2] == ">" and len(texts[6]) == 3
    jsonschema.validate(json.loads(texts[7]), SCHEMA)


def test_a_streamed_constrained_answer_joins_into_valid_json(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json={
        "messages": HI, "max_tokens": 60, "seed": 5, "stream": True,
        "structured_outputs": {"json": SCHEMA}})
    chunks = chunks_of(response)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_p_less_reaches_the_sampler_from_both_endpoints(client: httpx.Client) -> None:
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": HI})):
        reply = client.post(path, json={**body, "max_tokens": 4, "p_less": True, "seed": 2})
        assert reply.status_code == 200, reply.text
    assert_error(client.post("/v1/completions", json={"prompt": "x", "p_less": "yes"}), 400, "p_less")


class Answer(pydantic.BaseModel):
    city: Annotated[str, pydantic.Field(max_length=6)]
    rank: Annotated[int, pydantic.Field(ge=1, le=9)]
    kind: Literal["town", "village"]
    open: bool


def test_the_openai_clients_parse_helper_gets_its_pydantic_model(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0)
    completion = client.beta.chat.completions.parse(model=MODEL, messages=HI, response_format=Answer,
                                                     max_tokens=60, seed=4)
    assert isinstance(completion.choices[0].message.parsed, Answer)
    wait_idle(served)


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": json_schema_format({"type": "foo"})}, "response_format.json_schema.schema"),
    ({"response_format": json_schema_format({"type": "object", "dependentSchemas": {}})},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a+"}, "min_tokens": 2}, "min_tokens"),
    ({"structured_outputs": {"regex": "a+"}, "allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"guided_choice": ["yes", "no"], "bad_words": ["yes"]}, "bad_words"),
])
def test_bad_structured_output_requests_are_400_naming_the_field_before_engine_work(
        served: Served, client: httpx.Client, extra: dict, param: str) -> None:
    steps = served.engine.stats.steps
    assert_error(client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, **extra}),
                 400, param)
    assert served.engine.stats.steps == steps
