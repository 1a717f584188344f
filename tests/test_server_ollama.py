"""Ollama's API on /api/*, through the official `ollama` client over loopback: chat, generate
(streamed NDJSON and whole), embed, tags, show, ps and version; Ollama's option names mapped
onto the sampler's; and 400s that name the field. Also Anthropic's /v1/messages/count_tokens."""

from __future__ import annotations

import datetime as dt
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import ollama
import pytest
from test_server_api import Served, idle_client, keyed_serving, serving, tiny_engine, wait_idle
from test_server_reasoning import OPENS_THE_BLOCK, thinking_model_dir  # noqa: F401 (a fixture)

from nanoserve.server.generation import Choice
from nanoserve.server.ollama.api import (
    OLLAMA_DEFAULTS,
    OLLAMA_REFUSED,
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
    OllamaShowRequest,
    Shape,
    chat_request,
)
from nanoserve.server.parsers.reasoning import ReasoningConfig

KEY = "sk-ollama-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "num_predict": 10}
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    with keyed_serving(tiny_model_dir, KEY) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[ollama.Client]:
    yield ollama.Client(host=served.base_url, headers=AUTH)
    wait_idle(served)


@pytest.fixture
def http(served: Served) -> Iterator[httpx.Client]:
    with idle_client(served) as client:
        client.headers.update(AUTH)
        yield client


def openai_chat(http: httpx.Client, messages: list[dict], **fields) -> dict:
    return http.post("/v1/chat/completions", json={"messages": messages, **fields}).json()


@pytest.mark.parametrize(("theirs", "ours", "prefix"), [
    (ollama._types.GenerateRequest, OllamaGenerateRequest, ""),
    (ollama._types.ChatRequest, OllamaChatRequest, ""),
    (ollama._types.EmbedRequest, OllamaEmbedRequest, ""),
    (ollama._types.ShowRequest, OllamaShowRequest, ""),
    (ollama._types.Options, OllamaOptions, "options."),
    (ollama._types.Message, OllamaMessage, "messages[]."),
])
def test_every_field_the_ollama_client_can_send_is_honoured_or_refused_by_name(theirs, ours, prefix) -> None:
    for name in theirs.model_fields:
        assert name in ours.model_fields or prefix + name in OLLAMA_REFUSED, prefix + name


def test_a_chat_is_the_chat_completion_of_the_same_conversation(client, http) -> None:
    reply = client.chat(model="tiny", messages=HI, options=GREEDY)
    chat = openai_chat(http, HI, temperature=0, max_tokens=10)
    assert reply.message.role == "assistant" and reply.done is True
    assert reply.message.content == chat["choices"][0]["message"]["content"]
    assert reply.done_reason == {"length": "length", "stop": "stop"}[chat["choices"][0]["finish_reason"]]
    assert reply.prompt_eval_count == chat["usage"]["prompt_tokens"]
    assert reply.eval_count == chat["usage"]["completion_tokens"]
    assert reply.total_duration >= reply.prompt_eval_duration > 0 and reply.eval_duration >= 0
    assert reply.model == "tiny" and reply.created_at.endswith("Z")


def test_a_streamed_chat_joins_into_the_whole_one_and_ends_with_the_timings(client) -> None:
    whole = client.chat(model="tiny", messages=HI, options=GREEDY)
    parts = list(client.chat(model="tiny:latest", messages=HI, options=GREEDY, stream=True))
    assert all(part.done is False for part in parts[:-1]) and parts[-1].done is True
    assert "".join(part.message.content for part in parts) == whole.message.content
    last = parts[-1]
    assert (last.done_reason, last.eval_count) == (whole.done_reason, whole.eval_count)
    assert last.total_duration > 0 and last.model == "tiny:latest"


def test_ollama_streams_ndjson_by_default_and_one_object_without(http) -> None:
    body = {"model": "tiny", "prompt": "Hi", "options": GREEDY}
    streamed = http.post("/api/generate", json=body)
    assert streamed.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert lines[-1]["done"] is True and len(lines) > 1
    assert set(lines[-1]) == {"model", "created_at", "response", "done", "done_reason", "total_duration",
                              "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                              "eval_duration"}
    whole = http.post("/api/generate", json={**body, "stream": False}).json()
    assert whole["response"] == "".join(line["response"] for line in lines)
    assert set(whole) == set(lines[-1])


def test_generate_renders_the_template_unless_raw(client, http) -> None:
    templated = client.generate(model="tiny", prompt="Hello there", system="Be brief.", options=GREEDY)
    chat = openai_chat(http, [{"role": "system", "content": "Be brief."}, *HI], temperature=0, max_tokens=10)
    assert templated.response == chat["choices"][0]["message"]["content"]
    raw = client.generate(model="tiny", prompt="The capital of France is", raw=True, options=GREEDY)
    completion = http.post("/v1/completions", json={"prompt": "The capital of France is", "temperature": 0,
                                                    "max_tokens": 10}).json()
    assert raw.response == completion["choices"][0]["text"]
    streamed = "".join(part.response for part in client.generate(
        model="tiny", prompt="The capital of France is", raw=True, options=GREEDY, stream=True))
    assert streamed == raw.response


def test_generate_on_a_model_without_a_chat_template_sends_the_prompt_as_it_is(tmp_path) -> None:
    from tiny_model import write_tiny_llama

    path = write_tiny_llama(tmp_path / "plain")
    config = path / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({k: v for k, v in settings.items() if k != "chat_template"}))
    with serving(lambda: tiny_engine(path)) as plain, idle_client(plain) as http:
        reply = http.post("/api/generate", json={"model": "tiny", "prompt": "Once", "stream": False,
                                                 "options": GREEDY}).json()
        completion = http.post("/v1/completions", json={"prompt": "Once", "temperature": 0,
                                                        "max_tokens": 10}).json()
        assert reply["response"] == completion["choices"][0]["text"]
        refused = http.post("/api/generate", json={"model": "tiny", "prompt": "Once", "system": "Be brief."})
        assert refused.status_code == 400 and "system" in refused.json()["error"]


def test_a_raw_generate_without_num_predict_runs_until_the_context_is_full(client, served: Served) -> None:
    reply = client.generate(model="tiny", prompt="Once", raw=True, options={"temperature": 0, "num_ctx": 40})
    assert reply.prompt_eval_count + reply.eval_count <= 40
    assert reply.done_reason == "length" or reply.eval_count < 40 - reply.prompt_eval_count


def test_ollamas_options_reach_the_sampler_under_their_own_names(client, http) -> None:
    options = {"temperature": 1.3, "top_k": 30, "top_p": 0.8, "min_p": 0.02, "typical_p": 0.9,
               "repeat_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2, "seed": 7,
               "num_predict": 12, "stop": ["\n\n"]}
    reply = client.chat(model="tiny", messages=HI, options=options)
    same = {**{k: v for k, v in options.items() if k not in ("repeat_penalty", "num_predict")},
            "repetition_penalty": 1.2, "max_tokens": 12}
    assert reply.message.content == openai_chat(http, HI, **same)["choices"][0]["message"]["content"]
    mirostat = {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "seed": 3}
    reply = client.chat(model="tiny", messages=HI, options={**mirostat, "num_predict": 8})
    chat = openai_chat(http, HI, **mirostat, temperature=0.8, max_tokens=8)
    assert reply.message.content == chat["choices"][0]["message"]["content"]


def test_no_options_mean_ollamas_defaults_and_mirostat_drops_top_k_and_top_p(served: Served) -> None:
    state = served.app.state.server
    plain = chat_request(state, OllamaChatRequest.model_validate({"model": "tiny", "messages": HI}), "tiny")
    assert {name: getattr(plain, name) for name in OLLAMA_DEFAULTS} == OLLAMA_DEFAULTS
    assert plain.max_tokens is None and plain.repetition_penalty is None
    steered = chat_request(state, OllamaChatRequest.model_validate(
        {"model": "tiny", "messages": HI, "options": {"mirostat": 1}}), "tiny")
    assert (steered.top_k, steered.top_p, steered.mirostat) == (None, None, 1)


def test_format_json_and_a_schema_constrain_the_reply(client) -> None:
    reply = client.chat(model="tiny", messages=HI, format="json", options={"num_predict": 60, "seed": 1})
    if reply.done_reason == "stop":
        assert isinstance(json.loads(reply.message.content), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    reply = client.generate(model="tiny", prompt="A number", format=schema, options={"num_predict": 40})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.response), schema)


def test_logprobs_come_in_ollamas_records(client) -> None:
    reply = client.chat(model="tiny", messages=HI, logprobs=True, top_logprobs=2, options=GREEDY)
    assert len(reply.logprobs) == reply.eval_count
    first = reply.logprobs[0]
    assert first.logprob <= 0 and len(first.top_logprobs) == 2
    assert first.token == first.top_logprobs[0].token  # greedy takes the most likely


def test_tags_ps_show_and_version_describe_the_served_model(client, served: Served) -> None:
    listed = client.list().models
    assert [m.model for m in listed] == ["tiny:latest"]
    details = listed[0].details
    assert details.family == "llama" and details.parameter_size.endswith(("M", "B")) and listed[0].size > 0
    running = client.ps().models
    assert running[0].model == "tiny:latest" and running[0].context_length == served.engine.max_model_len
    shown = client.show("tiny")
    assert "completion" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == served.engine.max_model_len
    assert shown.modelinfo["llama.embedding_length"] == served.engine.model_config.hidden_size
    with httpx.Client(base_url=served.base_url, headers=AUTH) as http:
        assert http.get("/api/version").json()["version"]


def test_embed_gives_the_embeddings_endpoints_vectors(client, http) -> None:
    reply = client.embed(model="tiny", input=["Hello there", "General Kenobi"])
    expected = http.post("/v1/embeddings", json={"input": ["Hello there", "General Kenobi"]}).json()
    assert [list(v) for v in reply.embeddings] == [item["embedding"] for item in expected["data"]]
    assert reply.prompt_eval_count == expected["usage"]["prompt_tokens"]


def test_an_empty_prompt_or_chat_loads_the_model_and_generates_nothing(http) -> None:
    loaded = http.post("/api/generate", json={"model": "tiny"}).json()
    assert (loaded["done"], loaded["done_reason"], loaded["response"]) == (True, "load", "")
    loaded = http.post("/api/chat", json={"model": "tiny", "messages": []}).json()
    assert (loaded["done_reason"], loaded["message"]["content"]) == ("load", "")


def test_a_one_model_servers_model_is_loaded_for_good_and_unloading_it_is_a_400(client, http) -> None:
    refused = http.post("/api/generate", json={"model": "tiny", "keep_alive": 0})
    assert refused.status_code == 400 and "keep_alive" in refused.json()["error"]
    assert client.chat(model="tiny", messages=HI, options=GREEDY, keep_alive=0).done is True
    (running,) = client.ps().models
    assert running.expires_at.year > dt.datetime.now(dt.UTC).year + 100  # Ollama's "never"


def test_a_conversation_with_earlier_tool_calls_is_accepted(client) -> None:
    messages = [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    reply = client.chat(model="tiny", messages=messages, tools=tools, options=GREEDY)
    assert reply.done is True


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/api/chat", {"messages": HI, "bogus": 1}, "bogus"),
    ("/api/chat", {"messages": HI, "options": {"num_gpu": 1}}, "options.num_gpu"),
    ("/api/chat", {"messages": HI, "options": {"temprature": 1}}, "options.temprature"),
    ("/api/chat", {"messages": HI, "options": {"temperature": -1}}, "options.temperature"),
    ("/api/chat", {"messages": HI, "options": {"repeat_penalty": 9}}, "options.repeat_penalty"),
    ("/api/chat", {"messages": HI, "options": {"repeat_last_n": 64}}, "options.repeat_last_n"),
    ("/api/chat", {"messages": HI, "options": {"num_predict": 0}}, "options.num_predict"),
    ("/api/chat", {"messages": HI, "options": {"num_ctx": 10**6}}, "options.num_ctx"),
    ("/api/chat", {"messages": HI, "options": {"mirostat": 2, "top_k": 40}}, "options.top_k"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
     "messages[0].images"),
    ("/api/chat", {"messages": [{"role": "narrator", "content": "hi"}]}, "messages[0].role"),
    ("/api/chat", {"messages": HI, "keep_alive": "forever"}, "keep_alive"),
    ("/api/chat", {"messages": HI, "think": True}, "think"),
    ("/api/chat", {"messages": HI, "truncate": True}, "truncate"),
    ("/api/chat", {"messages": HI, "format": "xml"}, "format"),
    ("/api/generate", {"prompt": "hi", "images": ["aGk="]}, "images"),
    ("/api/generate", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("/api/generate", {"prompt": "hi", "context": [1, 2]}, "context"),
    ("/api/generate", {"prompt": "hi", "template": "{{ .Prompt }}"}, "template"),
    ("/api/embed", {"input": "hi", "options": {"temperature": 1}}, "options.temperature"),
    ("/api/embed", {"input": "hi", "dimensions": 3}, "dimensions"),
])
def test_a_bad_field_is_a_400_naming_it(http, path: str, body: dict, field: str) -> None:
    response = http.post(path, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"} and field in response.json()["error"]


def test_an_unknown_model_is_a_404_the_client_raises(client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="llama3", messages=HI)
    assert err.value.status_code == 404 and "llama3" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.show("llama3")
    assert err.value.status_code == 404


def test_the_api_needs_the_key_and_answers_in_ollamas_shape(served: Served) -> None:
    with httpx.Client(base_url=served.base_url) as http:
        response = http.post("/api/chat", json={"model": "tiny", "messages": HI})
    assert response.status_code == 401 and set(response.json()) == {"error"}


def test_count_tokens_counts_what_a_message_request_takes_as_input(served: Served) -> None:
    body = {"model": "tiny", "system": "Be brief.", "messages": HI,
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}
    with anthropic.Anthropic(base_url=served.base_url, api_key=KEY, max_retries=0) as client:
        counted = client.messages.count_tokens(**body)
        reply = client.messages.create(max_tokens=2, **body)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    with httpx.Client(base_url=served.base_url, headers={"x-api-key": KEY}) as http:
        bad = http.post("/v1/messages/count_tokens", json={**body, "temperature": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    wait_idle(served)


# -- thinking, tool calls ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking_served(thinking_model_dir) -> Iterator[Served]:  # noqa: F811 (the imported fixture)
    """The tiny model with think tags and a template that opens the block: it thinks first."""
    config = Path(thinking_model_dir) / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": OPENS_THE_BLOCK}))
    with serving(lambda: tiny_engine(thinking_model_dir), reasoning=ReasoningConfig("qwen3")) as server:
        yield server


def test_think_puts_the_thinking_apart_whole_and_streamed(thinking_served: Served) -> None:
    client = ollama.Client(host=thinking_served.base_url)
    reply = client.chat(model="tiny", messages=HI, think=True, options=GREEDY)
    with idle_client(thinking_served) as http:
        chat = openai_chat(http, HI, temperature=0, max_tokens=10)["choices"][0]["message"]
    assert reply.message.thinking == chat["reasoning_content"] and reply.message.thinking
    assert reply.message.content == chat["content"]
    parts = list(client.chat(model="tiny", messages=HI, think=True, options=GREEDY, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == reply.message.thinking
    assert "".join(p.message.content for p in parts) == reply.message.content
    generated = client.generate(model="tiny", prompt=HI[0]["content"], think=True, options=GREEDY)
    assert generated.thinking == reply.message.thinking
    assert "thinking" in client.show("tiny").capabilities
    wait_idle(thinking_served)


def fake_generation() -> SimpleNamespace:
    choice = Choice(0, 0, "r-0", 5, first_s=time.perf_counter(), last_s=time.perf_counter())
    return SimpleNamespace(choices={"r-0": choice}, arrival_s=time.perf_counter() - 0.5,
                           usage=lambda: {"prompt_tokens": 5, "completion_tokens": 3})


def test_tool_calls_come_back_as_ollamas_with_their_arguments_as_objects() -> None:
    shape = Shape("chat", "chat", "tiny")
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"y": '}}]
    whole = shape.whole({"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "", "tool_calls": calls}}]}, fake_generation())
    assert whole["message"]["tool_calls"] == [  # the second was cut before its arguments closed
        {"id": "call_1", "function": {"index": 0, "name": "f", "arguments": {"x": 1}}}]
    assert whole["done_reason"] == "stop" and whole["eval_count"] == 3
    streamed: dict = {}
    for delta in ({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}):
        assert shape._delta_line({"delta": delta, "finish_reason": None}, streamed) is None
    assert streamed[0] == {"id": "call_1", "function": {"name": "f", "arguments": '{"x": 1}'}}


# -- a real `nanoserve serve` process ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_ollama_client_chats_generates_streams_lists_and_embeds_against_nanoserve_serve(
        tiny_model_dir, tmp_path) -> None:
    port = free_port()
    command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve", "--model",
               str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny", "--log-level",
               "warning"]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.1)
        client = ollama.Client(host=base_url)
        assert [m.model for m in client.list().models] == ["tiny:latest"]
        reply = client.chat(model="tiny", messages=HI, options=GREEDY)
        streamed = list(client.chat(model="tiny", messages=HI, options=GREEDY, stream=True))
        assert "".join(p.message.content for p in streamed) == reply.message.content
        assert streamed[-1].done and streamed[-1].eval_count == reply.eval_count
        generated = client.generate(model="tiny", prompt="Hello there", options=GREEDY)
        assert generated.response == reply.message.content  # the same chat through the template
        assert len(client.embed(model="tiny", input="Hello there").embeddings[0]) > 0
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    assert process.returncode == 0, log.read_text()[-3000:]
