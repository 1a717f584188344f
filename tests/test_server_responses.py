"""OpenAI's Responses API on /v1/responses through the official client's `responses.create`
and `responses.stream` over loopback: text, instructions, function calls and their outputs,
text.format, the stateless refusals and 400s that name the field, and the API key."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from test_server_api import (
    Served,
    assert_error,
    idle_client,
    keyed_serving,
    openai_client,
)

KEY = "sk-responses"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": WEATHER}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    with keyed_serving(tiny_model_dir, KEY) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai_client(served, KEY) as client:
        yield client


def chat(served: Served, messages: list[dict], max_tokens: int) -> dict:
    with idle_client(served) as http:
        return http.post("/v1/chat/completions", headers=AUTH, json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0}).json()


def test_a_response_is_the_chat_completion_of_its_input(client, served: Served) -> None:
    reply = client.responses.create(model="tiny", input="Hello there", instructions="Be brief.",
                                    max_output_tokens=12, temperature=0)
    expected = chat(served, [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hello there"}], 12)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert [item.type for item in reply.output] == ["message"]
    assert reply.output_text == expected["choices"][0]["message"]["content"]
    finish = expected["choices"][0]["finish_reason"]
    assert reply.status == {"length": "incomplete", "stop": "completed"}[finish]
    assert reply.usage.output_tokens == expected["usage"]["completion_tokens"]
    assert reply.usage.input_tokens == expected["usage"]["prompt_tokens"]


def test_message_items_become_the_conversation(client, served: Served) -> None:
    items = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "output_text", "text": "Hello!"}]}, {"role": "user", "content": [
            {"type": "input_text", "text": "More?"}]}]
    reply = client.responses.create(model="tiny", input=items, max_output_tokens=8, temperature=0)
    expected = chat(served, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                             {"role": "user", "content": "More?"}], 8)
    assert reply.output_text == expected["choices"][0]["message"]["content"]


def test_a_streamed_response_joins_into_the_unary_one(client) -> None:
    request = {"model": "tiny", "input": "Hello there", "max_output_tokens": 12, "temperature": 0}
    unary = client.responses.create(**request)
    kinds, deltas = [], []
    with client.responses.stream(**request) as stream:
        for item in stream:
            kinds.append(item.type)
            if item.type == "response.output_text.delta":
                deltas.append(item.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == unary.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and final.status == unary.status
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.content_part.done", "response.output_item.done"} <= set(kinds)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_replies_with_a_function_call_item(client, stream: bool) -> None:
    request = {"model": "tiny", "input": "Weather in Oslo?", "tools": TOOLS, "tool_choice": "required",
               "parallel_tool_calls": False, "max_output_tokens": 60, "temperature": 0}
    if stream:
        with client.responses.stream(**request) as events:
            reply = events.get_final_response()
    else:
        reply = client.responses.create(**request)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert reply.status == "completed" and [call.name for call in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_function_call_and_output_items_round_trip(client, served: Served) -> None:
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "-3 C"}]
    reply = client.responses.create(model="tiny", input=items, tools=TOOLS, max_output_tokens=6,
                                    temperature=0)
    # The tiny model's ChatML template renders content alone: the same tokens as these turns.
    expected = chat(served, [{"role": "user", "content": "Weather in Oslo?"},
                             {"role": "assistant", "content": ""}, {"role": "tool", "content": "-3 C"}], 6)
    assert reply.usage.input_tokens == expected["usage"]["prompt_tokens"]


def test_text_format_json_schema_holds_the_text_to_the_schema(client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.responses.create(model="tiny", input="ok?", max_output_tokens=30, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
    jsonschema.validate(json.loads(reply.output_text), schema)


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": "x", "store": True}, "store", "unsupported"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "unsupported"),
    ({"input": "x", "background": True}, "background", "unsupported"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "unsupported"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported"),
    ({"input": "x", "max_output_token": 3}, "max_output_token", "unknown_field"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url", "unsupported"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id", None),
    ({"input": []}, "input", None),
])
def test_a_bad_body_is_a_400_naming_the_field(served: Served, body, param, code) -> None:
    steps = served.engine.stats.steps
    with idle_client(served) as http:
        assert_error(http.post("/v1/responses", headers=AUTH, json={"max_output_tokens": 4, **body}),
                     400, param, code)
    assert served.engine.stats.steps == steps


def test_the_api_key_is_required(served: Served) -> None:
    with idle_client(served) as http:
        assert http.post("/v1/responses", json={"input": "x"}).status_code == 401
    with (openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="wrong", max_retries=0) as wrong,
          pytest.raises(openai.AuthenticationError)):
        wrong.responses.create(model="tiny", input="x", max_output_tokens=2)


def test_store_false_and_harmless_values_are_accepted(client) -> None:
    reply = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False,
                                    truncation="disabled", include=[], service_tier="auto")
    assert reply.status in ("completed", "incomplete")
