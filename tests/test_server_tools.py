"""Tool calling on /v1/chat/completions: constrained calls on the tiny model (random weights:
only the grammar makes the arguments parse), the auto parser, streaming, the template round
trip and the 400s."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import jsonschema
import openai
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

from nanoserve.server.openai.protocol import ChatCompletionRequest
from nanoserve.server.parsers.tool_calls import ToolPlan
from nanoserve.tokenizer import Tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HI = [{"role": "user", "content": "weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    with serving(lambda: tiny_engine(tiny_model_dir)) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[httpx.Client]:
    with idle_client(served) as http:
        yield http


def assert_valid_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_required_and_named_tool_choice_reply_with_calls_that_validate(client: httpx.Client,
                                                                        tool_choice) -> None:
    # One call: random weights would otherwise append calls until max_tokens.
    reply = client.post("/v1/chat/completions", json={
        "messages": HI, "tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False,
        "max_tokens": 80, "seed": 2}).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    assert_valid_calls(choice["message"]["tool_calls"])
    if tool_choice is NAMED:
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_streamed_calls_join_into_the_openai_shape(client: httpx.Client, tool_choice) -> None:
    chunks = chunks_of(client.post("/v1/chat/completions", json={
        "messages": HI, "tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False,
        "max_tokens": 80, "seed": 2, "stream": True}))
    assert_valid_calls(_calls_of(chunks))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _closing_brackets(model_dir) -> dict[str, float]:
    """A logit bias that keeps greedy decoding from closing an array: every token with a "]"."""
    tokenizer = Tokenizer.from_dir(model_dir)
    return {str(i): -100.0 for i in range(tokenizer.vocab_size) if "]" in tokenizer.decode([i])}


def _whole_items(text: str) -> list[dict]:
    """The longest prefix of a cut JSON array that closes into a list (json's verdict, not ours)."""
    for end in range(len(text), 0, -1):
        if text[end - 1] == "}":
            with contextlib.suppress(ValueError):
                return json.loads(text[:end] + "]")
    return []


def _calls_of(chunks: list[dict]) -> list[dict]:
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for part in chunk["choices"][0]["delta"].get("tool_calls", []):
            call = calls.setdefault(part["index"], {"id": part.get("id"), "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += part.get("function", {}).get("name", "")
            call["function"]["arguments"] += part.get("function", {}).get("arguments", "")
    return list(calls.values())


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_by_max_tokens_returns_the_calls_it_completed(
        client: httpx.Client, tiny_model_dir, stream: bool) -> None:
    # "]" banned: greedy decoding appends calls until max_tokens cuts one, as a weak model does.
    request = {"messages": HI, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120,
               "temperature": 0, "logit_bias": _closing_brackets(tiny_model_dir), "logprobs": True}
    reply = client.post("/v1/chat/completions", json={**request, "stream": stream})
    if stream:
        chunks = chunks_of(reply)
        calls, finish = _calls_of(chunks), chunks[-1]["choices"][0]["finish_reason"]
        tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    else:
        choice = reply.json()["choices"][0]
        calls, finish = choice["message"].get("tool_calls", []), choice["finish_reason"]
        assert choice["message"]["content"] is None
        tokens = choice["logprobs"]["content"]
    expected = _whole_items(bytes(b for token in tokens for b in token["bytes"]).decode())
    assert finish == "length"
    assert expected, "the cut reply should have completed a call"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (item["name"], item["parameters"]) for item in expected]
    assert_valid_calls(calls)


def test_parallel_tool_calls_false_lets_the_grammar_close_after_one_call(
        client: httpx.Client, tiny_model_dir) -> None:
    # With "]" banned only the grammar can close the array; a second call would be taken if allowed.
    reply = client.post("/v1/chat/completions", json={
        "messages": HI, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
        "max_tokens": 120, "temperature": 0, "logit_bias": _closing_brackets(tiny_model_dir)}).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert len(choice["message"]["tool_calls"]) == 1
    assert_valid_calls(choice["message"]["tool_calls"])


def test_the_reader_keeps_whole_items_of_a_cut_array() -> None:
    text = '[{"name": "get_time", "parameters": {"zone": 1}}, {"name": "get_time", "parameters": {"zo'
    content, calls = reader("required").read(text, cut=True)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": 1}]
    assert reader("required").read('[{"name": "get_ti', cut=True) == (None, [])


def test_the_openai_client_reads_the_calls(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=80, seed=1)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    wait_idle(served)


def test_assistant_calls_and_tool_results_round_trip_into_the_request(client: httpx.Client) -> None:
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    reply = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 4})
    assert reply.status_code == 200, reply.text


def test_the_template_sees_tools_calls_and_tool_results(tiny_model_dir) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    tokenizer.chat_template = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
        "{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{% endfor %}")
    body = ChatCompletionRequest.model_validate({"messages": [
        *HI, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3"}], "tools": TOOLS})
    text = tokenizer.apply_chat_template(body.chat_messages(), add_generation_prompt=False,
                                         tools=ToolPlan.from_body(body).template_tools())
    assert text == ("[tool get_weather][tool get_time]<user>weather?<assistant>[call get_weather Oslo]"
                    "<tool>-3[for c1]")


def reader(choice: str = "auto"):
    body = SimpleNamespace(tools=TOOLS, tool_choice=choice)
    return ToolPlan.from_body(body).reader()


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [*HI, {"role": "assistant",
                         "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400_naming_the_field_before_engine_work(
        served: Served, client: httpx.Client, extra: dict, param: str) -> None:
    steps = served.engine.stats.steps
    assert_error(client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, **extra}),
                 400, param)
    assert served.engine.stats.steps == steps
