"""Anthropic's Messages API on /v1/messages, through the official `anthropic` client over
loopback: unary and streamed text, stop sequences, tools (tool_use and tool_result blocks,
streamed input), structured output, the key in x-api-key, and 400s that name the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest
from test_server_api import Served, idle_client, keyed_serving, wait_idle

KEY = "sk-test-1"
HI = [{"role": "user", "content": "Hello there"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    with keyed_serving(tiny_model_dir, KEY) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=served.base_url, api_key=KEY, max_retries=0) as messages_client:
        yield messages_client
    wait_idle(served)


def chat_text(served: Served, messages: list[dict], max_tokens: int) -> dict:
    """The same request on /v1/chat/completions, greedy."""
    with idle_client(served) as http:
        return http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0}).json()


def test_a_message_is_the_chat_completion_of_the_same_conversation(client, served: Served) -> None:
    reply = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=HI,
                                   extra_body=GREEDY)
    chat = chat_text(served, [{"role": "system", "content": "Be brief."}, *HI], 12)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == chat["choices"][0]["message"]["content"]
    finish = chat["choices"][0]["finish_reason"]
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert reply.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]


def test_a_stop_sequence_ends_the_message_and_is_named(client) -> None:
    whole = client.messages.create(model="tiny", max_tokens=16, messages=HI,
                                   extra_body=GREEDY).content[0].text
    stop = whole[4:6]
    assert len(stop) == 2, "the greedy reply is too short to cut"
    reply = client.messages.create(model="tiny", max_tokens=16, messages=HI, stop_sequences=[stop],
                                   extra_body=GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == whole[:whole.index(stop)]


def test_a_streamed_message_joins_into_the_unary_one(client) -> None:
    unary = client.messages.create(model="tiny", max_tokens=12, messages=HI, extra_body=GREEDY)
    kinds = []
    with client.messages.stream(model="tiny", max_tokens=12, messages=HI, extra_body=GREEDY) as stream:
        for item in stream:
            kinds.append(item.type)
        final = stream.get_final_message()
    assert final.content[0].text == unary.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (unary.stop_reason, unary.usage.output_tokens)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_replies_with_a_tool_use_block_whose_input_validates(client, stream: bool) -> None:
    request = {"model": "tiny", "max_tokens": 60, "messages": HI, "tools": TOOLS,
               "tool_choice": {"type": "tool", "name": "get_weather"}, "extra_body": GREEDY}
    if stream:
        with client.messages.stream(**request) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**request)
    uses = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and [use.name for use in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER)


def test_tool_choice_any_with_parallel_use_disabled_makes_one_call(client) -> None:
    reply = client.messages.create(model="tiny", max_tokens=60, messages=HI, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body=GREEDY)
    uses = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, WEATHER)


def test_tool_use_and_tool_result_blocks_reach_the_template(client, served: Served) -> None:
    messages = [*HI, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C"}]}]
    reply = client.messages.create(model="tiny", max_tokens=4, messages=messages, tools=TOOLS,
                                   extra_body=GREEDY)
    chat = chat_text(served, [*HI, {"role": "assistant", "content": "Let me look."},
                              {"role": "tool", "content": "-3 C"}], 4)
    # The tiny model's ChatML template renders content alone: the same tokens as the chat turns.
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]


def test_output_config_format_holds_the_text_to_the_schema(client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.messages.create(model="tiny", max_tokens=30, messages=HI, extra_body={
        "temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    jsonschema.validate(json.loads(reply.content[0].text), schema)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": HI}, "max_tokens"),
    ({"max_tokens": 4, "messages": HI, "max_token": 5}, "max_token"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages[0].content[0].source"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t",
                                                                  "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": HI, "container": "c1"}, "container"),
    ({"max_tokens": 4, "messages": HI, "tool_choice": {"type": "tool"}, "tools": TOOLS}, "tool_choice.name"),
    ({"max_tokens": 4, "messages": HI, "temperature": "hot"}, "temperature"),
])
def test_a_bad_body_is_a_400_in_anthropic_shape_naming_the_field(served: Served, client, body, param) -> None:
    steps = served.engine.stats.steps
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.post("/v1/messages", body=body, cast_to=httpx.Response)
    error = raised.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param, error
    assert served.engine.stats.steps == steps


def test_the_key_is_taken_from_x_api_key_or_a_bearer_token(served: Served) -> None:
    with anthropic.Anthropic(base_url=served.base_url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            wrong.messages.create(model="tiny", max_tokens=2, messages=HI)
        assert raised.value.body["type"] == "error"
    with idle_client(served) as http:
        body = {"max_tokens": 2, "messages": HI}
        assert http.post("/v1/messages", json=body).status_code == 401
        assert http.post("/v1/messages", json=body, headers={"x-api-key": KEY}).status_code == 200
        bearer = {"Authorization": f"Bearer {KEY}"}
        assert http.post("/v1/messages", json=body, headers=bearer).status_code == 200
