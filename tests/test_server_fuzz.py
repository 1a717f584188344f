"""Property-based fuzzing of the POST endpoints: no body ever gets a 500 or hangs.

Hypothesis writes request bodies field by field, mixing plausible values (edge floats, huge and
negative integers, token ids outside the vocabulary, odd messages) with JSON of the wrong
shape, plus raw bytes that are not JSON at all, on completions, chat completions, Responses,
Anthropic's Messages, embeddings and the tokenizer routes. Each answer must be a well-formed
answer of the route's protocol: a 200 with choices (or an SSE stream ending in [DONE]; the
others: their own shape and their own last stream event), or an error object whose status is
a client error naming the field (Anthropic's shape on /v1/messages). Bounded: a
fixed number of examples, each request under a read timeout, a tiny model and a small
max_tokens limit. Afterwards the engine is still healthy and its pool completely free.
"""

from __future__ import annotations

import json
import string
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import BackgroundServer

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.server.app import ServerLimits, build_app

MODEL = "tiny"
REQUEST_TIMEOUT_S = 20.0
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
CLIENT_ERRORS = {400, 404, 413}


@pytest.fixture(scope="module")
def base_url(tiny_model_dir) -> Iterator[str]:
    limits = ServerLimits(max_tokens=16, max_n=3, max_prompts=3, max_body_bytes=16 * 1024)
    app = build_app(lambda: Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=8)),
                    model_names=[MODEL], limits=limits)
    with BackgroundServer(app) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.base_url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield server.base_url
        engine = app.state.server.async_engine
        deadline = time.monotonic() + 10
        while engine.num_in_flight or not engine.engine.pool.is_completely_free:
            assert time.monotonic() < deadline, "the pool did not come back after fuzzing"
            time.sleep(0.05)
        assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        yield http


# -- strategies -----------------------------------------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
words = st.text(alphabet=string.ascii_letters + " .,!?\n\t" + "éü🚀你", max_size=30)


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """The field's plausible values, or any JSON at all."""
    return strategy | json_values


VOCAB = st.integers(0, 383)  # the tiny tokenizer's ids
some_words = words.filter(str.strip)
# Values the server must accept, edges included (a temperature of 1e-300, top_k beyond the
# vocabulary, the largest seed); the fuzzer swaps single fields for any JSON at all.
VALID = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 16),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-300, 5e-324, 1e-8, 1e30, 1.7e308]),
    "top_p": st.floats(1e-6, 1) | st.sampled_from([1e-300, 5e-324, 1]),
    "top_k": st.sampled_from([-1, 1, 2, 50, 400, 10**6]),
    "min_p": st.floats(0, 1) | st.sampled_from([5e-324, 1]),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stop": some_words | st.lists(some_words, max_size=3),
    "seed": st.integers(0, 2**63 - 3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 2) | st.sampled_from([5e-324, 2]),
    "logit_bias": st.dictionaries(VOCAB.map(str), st.floats(-100, 100) | st.sampled_from([-100, 100]),
                                  max_size=4),
    "min_tokens": st.integers(0, 1),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(VOCAB, max_size=3),
    "user": words,
    "unknown_field": json_values,
}
COMPLETION_ONLY = {"logprobs": st.integers(0, 5), "echo": st.just(False), "best_of": st.just(1)}
CHAT_ONLY = {"logprobs": st.booleans(), "max_completion_tokens": st.integers(1, 16),
             "tools": st.just([]), "response_format": st.just({"type": "text"})}
# Edge values just outside what is allowed, for the mutation to draw from too.
INVALID_EDGES = st.sampled_from([-1, 0, -1e-300, 2.0000001, 101, 2**63, 2**64, -(2**63) - 1, 10**6, "", [],
                                 {}, "1", True, None, 1.5, [384], [-1], {"-1": 1}, {"99999": 1}])
prompts = some_words | st.lists(VOCAB, min_size=1, max_size=8) | st.lists(some_words, min_size=1, max_size=3)
content_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), min_size=1,
                         max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": words | content_parts}),
    min_size=1, max_size=3)


def bodies(required: dict[str, st.SearchStrategy], fields: dict[str, st.SearchStrategy]
           ) -> st.SearchStrategy:
    """Valid bodies (the engine runs them), valid bodies with one field replaced by an edge
    value or any JSON (or a required field missing), and any JSON object at all."""
    valid = st.fixed_dictionaries(required, optional=fields)
    mutated = st.tuples(valid, st.sampled_from([*required, *fields, "echo", "suffix", "best_of", "tools",
                                                "top_logprobs", "stream_options", "response_format"]),
                        INVALID_EDGES | json_values | st.just(...)).map(lambda case: _mutate(*case))
    anything = st.fixed_dictionaries({}, optional={name: maybe(value) for name, value in
                                                   {**required, **fields}.items()})
    return valid | mutated | mutated | anything


def _mutate(body: dict, key: str, value: object) -> dict:
    body = dict(body)
    if value is ...:
        body.pop(key, None)
    else:
        body[key] = value
    return body


completion_bodies = bodies({"prompt": prompts}, VALID | COMPLETION_ONLY)
chat_bodies = bodies({"messages": messages}, VALID | CHAT_ONLY)

raw_bodies = st.binary(max_size=64) | st.text(max_size=64).map(str.encode) | json_values.map(
    lambda value: json.dumps(value).encode()) | st.sampled_from([
        b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "top_p": Infinity}', b'{"prompt": "a",}',
        b'{"messages": [{"role": "user", "content": "a"}], "n": 1e999}', rb'{"prompt": "\ud800"}'])


# -- checks ---------------------------------------------------------------------------------------

def check_answer(response: httpx.Response) -> None:
    status = response.status_code
    assert status == 200 or status in CLIENT_ERRORS, response.text
    if status == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
            assert events[-1] == "[DONE]"
            for event in events[:-1]:
                assert "error" not in json.loads(event), event
        else:
            assert isinstance(response.json()["choices"], list)
        return
    assert status in CLIENT_ERRORS, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert isinstance(error["param"], str) and error["param"], error


@FUZZ
@given(body=completion_bodies)
def test_completions_never_500_or_hang(client: httpx.Client, body: dict) -> None:
    check_answer(client.post("/v1/completions", json=body))


@FUZZ
@given(body=chat_bodies)
def test_chat_completions_never_500_or_hang(client: httpx.Client, body: dict) -> None:
    check_answer(client.post("/v1/chat/completions", json=body))


# -- Responses, Anthropic's Messages and embeddings: each from its own protocol's fields ---------

RESPONSES_FIELDS = {
    "model": st.just(MODEL), "max_output_tokens": st.integers(1, 16),
    "temperature": VALID["temperature"], "top_p": VALID["top_p"], "instructions": words,
    "stream": st.booleans(), "user": words,
    "text": st.just({"format": {"type": "text"}}), "tools": st.just([]), "unknown_field": json_values}
MESSAGES_FIELDS = {
    "model": st.just(MODEL), "system": words | content_parts,
    "stop_sequences": st.lists(some_words, max_size=3),
    "temperature": st.floats(0, 1), "top_p": VALID["top_p"], "top_k": st.integers(1, 400),
    "stream": st.booleans(), "metadata": st.fixed_dictionaries({"user_id": words}),
    "unknown_field": json_values}
EMBEDDINGS_FIELDS = {
    "model": st.just(MODEL), "encoding_format": st.sampled_from(["float", "base64"]),
    "dimensions": st.integers(1, 100), "normalize": st.booleans(),
    "truncate_prompt_tokens": st.integers(1, 8),
    "user": words, "unknown_field": json_values}
responses_input = some_words | st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": words}),
    min_size=1, max_size=3)
anthropic_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": words | content_parts}),
    min_size=1, max_size=3)
embedding_inputs = prompts | st.lists(st.lists(VOCAB, min_size=1, max_size=4), min_size=1, max_size=2)
OTHER_ROUTES = {
    "/v1/responses": bodies({"input": responses_input}, RESPONSES_FIELDS),
    "/v1/messages": bodies({"messages": anthropic_messages, "max_tokens": st.integers(1, 16)},
                           MESSAGES_FIELDS),
    "/v1/embeddings": bodies({"input": embedding_inputs}, EMBEDDINGS_FIELDS),
}
# A stream's last event, by route: each protocol's own end (Responses and Messages send no [DONE]).
LAST_EVENTS = {"/v1/responses": "response.completed", "/v1/messages": "message_stop"}
UNARY_SHAPES = {"/v1/responses": ("object", "response"), "/v1/messages": ("type", "message"),
                "/v1/embeddings": ("object", "list")}


def check_protocol_answer(path: str, response: httpx.Response) -> None:
    """As `check_answer`, in the route's own protocol: Anthropic's error shape on /v1/messages."""
    status = response.status_code
    assert status == 200 or status in CLIENT_ERRORS, response.text
    if status != 200:
        body = response.json()
        error = body["error"]
        if path == "/v1/messages":
            assert body["type"] == "error" and error["type"] == "invalid_request_error", body
        assert error["message"] and isinstance(error["param"], str) and error["param"], body
    elif response.headers["content-type"].startswith("text/event-stream"):
        blocks = [block for block in response.text.split("\n\n") if block]
        events = [block.split("\n")[0].removeprefix("event: ") for block in blocks]
        assert "error" not in events and events[-1] == LAST_EVENTS[path], response.text[-2000:]
    else:
        key, value = UNARY_SHAPES[path]
        assert response.json()[key] == value, response.text[:2000]


@settings(FUZZ, max_examples=40)
@given(data=st.data())
@pytest.mark.parametrize("path", sorted(OTHER_ROUTES))
def test_responses_messages_and_embeddings_never_500_or_hang(client: httpx.Client, path: str,
                                                              data: st.DataObject) -> None:
    check_protocol_answer(path, client.post(path, json=data.draw(OTHER_ROUTES[path], label="body")))


@settings(FUZZ, max_examples=60)
@given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", *OTHER_ROUTES]))
def test_arbitrary_bytes_never_500_or_hang(client: httpx.Client, raw: bytes, path: str) -> None:
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    if path in OTHER_ROUTES:
        check_protocol_answer(path, response)
    else:
        check_answer(response)


tokenizer_bodies = st.fixed_dictionaries({}, optional={
    "prompt": maybe(words), "messages": maybe(messages), "model": maybe(st.sampled_from([MODEL, "nope"])),
    "tokens": st.lists(VOCAB | INVALID_EDGES, max_size=6) | json_values})


@settings(FUZZ, max_examples=60)
@given(body=tokenizer_bodies | json_values, raw=raw_bodies,
       path=st.sampled_from(["/tokenize", "/detokenize"]))
def test_tokenize_and_detokenize_never_500_or_hang(client: httpx.Client, body: object, raw: bytes,
                                                   path: str) -> None:
    for response in (client.post(path, json=body),
                     client.post(path, content=raw, headers={"content-type": "application/json"})):
        if response.status_code == 200:
            keys = {"tokens", "count", "max_model_len"} if path == "/tokenize" else {"prompt"}
            assert set(response.json()) == keys
        else:
            check_answer(response)
