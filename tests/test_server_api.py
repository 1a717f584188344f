"""The server's API on the tiny model, over a real loopback socket in this process.

Every endpoint, the error shapes and statuses, auth, limits, SSE framing, include_usage, n,
logprobs, and that a client hanging up frees its blocks. The server runs in a thread
(`BackgroundServer`) so the tests can look at the engine's pool after each one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from server_harness import BackgroundServer

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.engine.output import TokenLogprob
from nanoserve.llm import LLM
from nanoserve.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from nanoserve.server.app import ServerLimits, build_app, start_drain
from nanoserve.server.openai.protocol import CompletionRequest, TextOffset, TokenText, completion_logprobs
from nanoserve.server.planning import _base_params
from nanoserve.server.tenants import Tenancy, tenants_from_options

MODEL = "tiny"
LIMITS = ServerLimits(max_body_bytes=32 * 1024, max_n=4, max_prompts=4, max_tokens=48, max_waiting=8,
                      body_timeout_s=1.0)


@dataclass
class Served:
    base_url: str
    app: object

    @property
    def async_engine(self):
        return self.app.state.server.async_engine

    @property
    def engine(self) -> Engine:
        return self.async_engine.engine


def wait_healthy(base_url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{base_url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the server never became healthy"
        time.sleep(0.05)


def wait_idle(served: Served, timeout_s: float = 10.0) -> None:
    """Every sequence finished or aborted and the pool completely free, as /metrics says too."""
    deadline = time.monotonic() + timeout_s
    while True:
        snapshot = served.async_engine.snapshot
        if (served.async_engine.num_in_flight == 0 and snapshot.running == 0 and snapshot.waiting == 0
                and snapshot.kv_cache_usage == 0.0 and served.engine.pool.is_completely_free):
            return
        assert time.monotonic() < deadline, f"not idle: {snapshot}"
        time.sleep(0.02)


def tiny_engine(model_dir, **overrides) -> Engine:
    options = {"model": str(model_dir), "num_kv_blocks": 96, "max_num_seqs": 8, **overrides}
    return Engine(EngineConfig(**options))


@contextlib.contextmanager
def serving(engine_factory, **app_options) -> Iterator[Served]:
    """A fresh server of `engine_factory`'s engine on loopback, healthy before it is yielded."""
    app = build_app(engine_factory, model_names=[MODEL], **app_options)
    with BackgroundServer(app) as server:
        wait_healthy(server.base_url)
        yield Served(server.base_url, app)


@contextlib.contextmanager
def keyed_serving(model_dir, key: str) -> Iterator[Served]:
    """A fresh tiny-model server whose one API key is `key`."""
    tenancy = Tenancy(tuple(tenants_from_options([key])))
    with serving(lambda: tiny_engine(model_dir), tenancy=tenancy) as served:
        yield served


@contextlib.contextmanager
def openai_client(served: Served, key: str) -> Iterator[openai.OpenAI]:
    """The official client of `served`; on leaving, waits until the server is idle."""
    with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=key, max_retries=0) as client:
        yield client
    wait_idle(served)


@contextlib.contextmanager
def idle_client(served: Served, timeout_s: float = 60) -> Iterator[httpx.Client]:
    """A client of `served`; on leaving, waits until the server has no request left running."""
    with httpx.Client(base_url=served.base_url, timeout=timeout_s) as http:
        yield http
    wait_idle(served)


@contextlib.contextmanager
def held_server(engine_factory, **app_options) -> Iterator[tuple[Served, threading.Event]]:
    """A fresh server whose engine steps wait until the returned gate is set."""
    with serving(engine_factory, **app_options) as served:
        yield served, hold_engine_steps(served.engine)


def hold_engine_steps(engine: Engine) -> threading.Event:
    """Make every engine step wait (at most 5 s) until the returned event is set."""
    gate = threading.Event()
    step = engine.step

    def held_step():
        gate.wait(5)
        return step()

    engine.step = held_step
    return gate


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    with serving(lambda: tiny_engine(tiny_model_dir), aliases=("tiny-alias",), limits=LIMITS) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[httpx.Client]:
    with idle_client(served, timeout_s=30) as http:
        yield http


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=96)


def events_of(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    text = response.text
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(block.startswith("data: ") and "\n" not in block for block in blocks), blocks
    return [block.removeprefix("data: ") for block in blocks]


def chunks_of(response: httpx.Response) -> list[dict]:
    events = events_of(response)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(event) for event in events[:-1]]


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code
    return error


# -- plain endpoints ------------------------------------------------------------------------------

def test_health_models_and_metrics(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in ("nanoserve_time_to_first_token_seconds_bucket", "nanoserve_inter_token_latency_seconds_sum",
                 "nanoserve_e2e_request_latency_seconds_count", "nanoserve_requests_running",
                 "nanoserve_requests_waiting", "nanoserve_kv_cache_usage_ratio",
                 "nanoserve_num_preemptions_total", "nanoserve_prompt_tokens_total",
                 "nanoserve_prefix_cache_queries_total", "nanoserve_prefix_cache_hits_total",
                 "nanoserve_generation_tokens_total"):
        assert name in metrics.text


def test_a_model_by_id_and_the_version(client: httpx.Client) -> None:
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/tiny-alias").json()["id"] == "tiny-alias"
    assert_error(client.get("/v1/models/gpt-9"), 404, "model", code="model_not_found")
    assert client.get("/version").json()["version"]


def test_health_is_503_while_the_model_loads(tiny_model_dir) -> None:
    release = threading.Event()

    def slow_engine() -> Engine:
        release.wait(30)
        return tiny_engine(tiny_model_dir)

    app = build_app(slow_engine, model_names=[MODEL])
    with BackgroundServer(app) as server:
        assert httpx.get(f"{server.base_url}/health").status_code == 503
        loading = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert_error(loading, 503, None)
        assert loading.headers["retry-after"] == "1"
        release.set()
        wait_healthy(server.base_url)


def test_metrics_count_latencies_and_end_idle(served: Served, client: httpx.Client) -> None:
    client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    wait_idle(served)
    text = client.get("/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#") and "_bucket" not in line}
    assert values["nanoserve_time_to_first_token_seconds_count"] >= 1
    assert values["nanoserve_inter_token_latency_seconds_count"] >= 3
    assert values["nanoserve_generation_tokens_total"] >= 4
    assert values["nanoserve_requests_running"] == 0
    assert values["nanoserve_kv_cache_usage_ratio"] == 0


# -- completions ----------------------------------------------------------------------------------

def test_unary_completion_matches_the_offline_engine(client: httpx.Client, offline: LLM) -> None:
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "text_completion" and data["model"] == MODEL and data["id"].startswith("cmpl-")
    [choice] = data["choices"]
    expected = offline.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0))[0]
    assert choice["text"] == expected.text
    assert choice["finish_reason"] == "length" == expected.finish_reason
    prompt_tokens = len(expected.prompt_token_ids)
    cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]  # other tests may share it
    assert data["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 12,
                             "total_tokens": prompt_tokens + 12,
                             "prompt_tokens_details": {"cached_tokens": cached}}
    assert 0 <= cached < prompt_tokens


def test_a_repeated_prompt_reports_cached_tokens_and_counts_prefix_cache_hits(
        served: Served, client: httpx.Client) -> None:
    def hits() -> dict[str, float]:
        text = client.get("/metrics").text
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("nanoserve_prefix_cache_")}

    prompt = list(range(300, 340))  # 40 token ids: two full 16-token blocks, then 8 more
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.post("/v1/completions", json=body).json()
    wait_idle(served)
    before = hits()
    second = client.post("/v1/completions", json=body).json()
    wait_idle(served)
    after = hits()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    gained = {name.removeprefix("nanoserve_prefix_cache_"): after[name] - before[name] for name in after}
    assert gained == {"queries_total": 40, "hits_total": 32}
    assert served.engine.pool.is_completely_free  # cached blocks count as free


def test_a_cache_salt_keeps_another_users_prefix_out_of_reach(client: httpx.Client) -> None:
    prompt = list(range(340, 300, -1))  # two full blocks and a bit, seen by no other test
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}

    def cached(**fields) -> int:
        usage = client.post("/v1/completions", json={**body, **fields}).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="secret-of-alice") == 0
    assert cached() == 0 and cached(cache_salt="guess") == 0  # no hit tells them anything
    assert cached(cache_salt="secret-of-alice") == 32
    assert_error(client.post("/v1/completions", json={**body, "cache_salt": ""}), 400, "cache_salt")


def test_model_alias_and_missing_model_are_accepted(client: httpx.Client) -> None:
    for body in ({"model": "tiny-alias"}, {}):
        response = client.post("/v1/completions", json={**body, "prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 200, response.text


def test_token_id_prompt_and_batch_of_prompts_with_n(client: httpx.Client, offline: LLM) -> None:
    ids = offline.tokenizer.encode("Once upon a time")
    single = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0}).json()
    batch = client.post("/v1/completions", json={
        "prompt": ["The dog", "Once upon a time"], "n": 2, "max_tokens": 5, "temperature": 0}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][2]["text"] == batch["choices"][3]["text"] == single["choices"][0]["text"]
    prompt_tokens = len(offline.tokenizer.encode("The dog")) + len(ids)
    assert batch["usage"]["prompt_tokens"] == prompt_tokens
    assert batch["usage"]["completion_tokens"] == 20


def test_n_choices_with_a_seed_differ_and_reproduce_as_seed_plus_i(client: httpx.Client) -> None:
    body = {"prompt": "Water boils at", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    first = client.post("/v1/completions", json=body).json()
    again = client.post("/v1/completions", json=body).json()
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1
    solo = client.post("/v1/completions", json={**body, "n": 1, "seed": 9}).json()
    assert solo["choices"][0]["text"] == texts[2]


def test_one_requests_choices_share_a_parent_for_the_fair_share(client: httpx.Client, served: Served,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    parents: list[str | None] = []
    add_request = served.engine.add_request

    def recording(*args, parent_id=None, **kwargs):
        parents.append(parent_id)
        return add_request(*args, parent_id=parent_id, **kwargs)

    monkeypatch.setattr(served.engine, "add_request", recording)
    for _ in range(2):
        body = {"prompt": ["The dog", "A cat"], "n": 2, "max_tokens": 2, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
    # Each HTTP request is one parent: its prompts and choices together, apart from the other.
    assert len(parents) == 8 and None not in parents
    assert len(set(parents[:4])) == 1 and len(set(parents[4:])) == 1 and parents[0] != parents[4]


def test_typical_p_and_top_n_sigma_reach_the_sampler_from_both_endpoints(client: httpx.Client,
                                                                          offline: LLM) -> None:
    modes = {"temperature": 1.5, "seed": 11, "typical_p": 0.6, "top_n_sigma": 1.0}
    expected = offline.generate("Water boils at", SamplingParams(max_tokens=8, **modes))[0].text
    body = {"prompt": "Water boils at", "max_tokens": 8, **modes}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **modes}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    parsed = _base_params(CompletionRequest.model_validate(body), seed=11)
    assert (parsed.typical_p, parsed.top_n_sigma) == (0.6, 1.0)


@pytest.mark.parametrize("modes", [
    {"dry_multiplier": 1.5, "dry_base": 2.0, "dry_allowed_length": 1, "dry_penalty_last_n": 16,
     "dry_sequence_breakers": ["\n", "."]},
    {"xtc_probability": 0.9, "xtc_threshold": 0.02},
    {"mirostat": 1, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    {"mirostat": 2, "mirostat_tau": 2.0},
])
def test_llama_cpps_samplers_reach_the_sampler_from_both_endpoints(client: httpx.Client, offline: LLM,
                                                                    modes: dict) -> None:
    sampled = {"temperature": 1.2, "seed": 5, **modes}
    expected = offline.generate("Water boils at", SamplingParams(max_tokens=8, **sampled))[0].text
    body = {"prompt": "Water boils at", "max_tokens": 8, **sampled}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **sampled}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    parsed = _base_params(CompletionRequest.model_validate(body), seed=5)
    assert all(getattr(parsed, name) == (tuple(value) if isinstance(value, list) else value)
               for name, value in modes.items())


def test_stop_string_ends_the_choice_before_it(client: httpx.Client) -> None:
    base = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    full = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    assert len(full) > 6
    stop = full[3:6]
    cut = client.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["stop_reason"] == stop
    assert cut["text"] == full[: full.index(stop)]


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token(client: httpx.Client,
                                                                            offline: LLM) -> None:
    base = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    full = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = full[3:6]
    kept = client.post("/v1/completions", json={**base, "stop": [stop], "include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["text"] == full[: full.index(stop) + len(stop)]
    greedy = offline.generate("Hello there", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [greedy.token_ids[2]], "include_stop_str_in_output": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    first = greedy.token_ids.index(greedy.token_ids[2])
    assert choice["text"] == offline.tokenizer.decode(greedy.token_ids[:first + 1])


def test_skip_special_tokens_false_shows_them_spaced_apart_unless_asked_not_to(client: httpx.Client,
                                                                              offline: LLM) -> None:
    [eos] = offline.tokenizer.eos_token_ids
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(eos): 100}}
    hidden = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    shown = client.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()
    joined = client.post("/v1/completions", json={**body, "skip_special_tokens": False,
                                                  "spaces_between_special_tokens": False}).json()
    assert "choices" in shown, shown
    assert hidden == ""
    # vLLM's default spaces_between_special_tokens sets each apart (from "Hello" too); false joins them.
    assert shown["choices"][0]["text"] == f" {offline.tokenizer.eos_token} {offline.tokenizer.eos_token}"
    assert joined["choices"][0]["text"] == offline.tokenizer.eos_token * 2


def test_allowed_token_ids_and_bad_words_reach_the_sampler(client: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    free = client.post("/v1/completions", json=body).json()["choices"][0]
    allowed = client.post("/v1/completions", json={**body, "allowed_token_ids": [40]}).json()
    only_40 = client.post("/detokenize", json={"tokens": [40] * 6}).json()["prompt"]
    assert allowed["choices"][0]["text"] == only_40
    word = free["logprobs"]["tokens"][0].strip()
    if word:
        banned = client.post("/v1/completions", json={**body, "bad_words": [word]}).json()["choices"][0]
        assert banned["logprobs"]["tokens"][0] != free["logprobs"]["tokens"][0]
    assert_error(client.post("/v1/completions", json={**body, "allowed_token_ids": [99999]}), 400,
                 "allowed_token_ids")


def test_truncate_prompt_tokens_keeps_the_prompts_tail(client: httpx.Client) -> None:
    body = {"prompt": list(range(50, 90)), "max_tokens": 3, "temperature": 0}
    cut = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 7}).json()
    tail = client.post("/v1/completions", json={**body, "prompt": list(range(83, 90))}).json()
    assert cut["usage"]["prompt_tokens"] == 7
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]


def test_echo_puts_the_prompt_before_the_text_unary_and_streamed(client: httpx.Client) -> None:
    body = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "Once upon" + plain
    streamed = chunks_of(client.post("/v1/completions", json={**body, "echo": True, "stream": True}))
    assert streamed[0]["choices"][0]["text"] == "Once upon"
    assert "".join(c["choices"][0]["text"] for c in streamed) == echoed
    assert_error(client.post("/v1/completions", json={**body, "echo": True, "logprobs": 1, "stream": True}),
                 400, "echo", "unsupported")


def test_echo_with_logprobs_puts_the_prompts_tokens_first_in_openais_shape(client: httpx.Client) -> None:
    """The prompt's tokens lead (the first with null logprob and alternatives), scored with the
    values prompt_logprobs gives; the generated tokens follow, offsets running on."""
    body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json={**body, "logprobs": 2}).json()["choices"][0]
    echoed = client.post("/v1/completions", json={**body, "logprobs": 2, "echo": True}).json()["choices"][0]
    scored = client.post("/v1/completions", json={**body, "prompt_logprobs": 2}).json()["choices"][0]
    logprobs, prompt = echoed["logprobs"], scored["prompt_logprobs"]
    n = len(prompt)
    assert echoed["text"] == "Once upon a time" + plain["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert logprobs["tokens"][n:] == plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][1:n] == [next(iter(position.values()))["logprob"]
                                               for position in prompt[1:]]
    assert all(len(top) in (2, 3) for top in logprobs["top_logprobs"][1:])
    assert "".join(logprobs["tokens"][:n]) == "Once upon a time"
    assert logprobs["text_offset"][n] == len("Once upon a time")
    assert logprobs["text_offset"][:n] == sorted(logprobs["text_offset"][:n])


def test_prompt_logprobs_in_vllms_shape_on_both_endpoints(client: httpx.Client) -> None:
    """Completions: per choice; chat: once, beside the choices. Null first, then a map of token
    id to logprob, rank and text, the prompt's own token first."""
    body = {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    ids = client.post("/tokenize", json={"prompt": "the cat sat"}).json()["tokens"]
    completion = client.post("/v1/completions", json={**body, "prompt": ids, "n": 2}).json()
    first, second = (choice["prompt_logprobs"] for choice in completion["choices"])
    assert first == second and first[0] is None and len(first) == len(ids)
    for position, token in zip(first[1:], ids[1:], strict=True):
        assert next(iter(position)) == str(token)
        top_ranks = [entry["rank"] for key, entry in position.items() if key != str(token)]
        assert len(position) in (2, 3) and top_ranks == sorted(top_ranks) and set(top_ranks) <= {1, 2}
        assert position[str(token)]["rank"] >= 1
        assert position[str(token)]["decoded_token"] == client.post(
            "/detokenize", json={"tokens": [token]}).json()["prompt"]
    chat = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200, chat.text
    chat_prompt = chat.json()["prompt_logprobs"]
    assert chat_prompt[0] is None and len(chat_prompt) == chat.json()["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in chat.json()["choices"][0]
    plain = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *content, last = chunks_of(client.post("/v1/completions", json=body))
    so_far = [c["usage"]["completion_tokens"] for c in content]
    # Tokens that reach the stream together share a chunk, so the count may step by more than one;
    # it never goes back, every chunk has one, and it ends at the whole completion.
    assert so_far == sorted(so_far) and so_far[0] >= 1 and so_far[-1] == 4, so_far
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in content)
    assert last["usage"]["completion_tokens"] == 4


def test_a_request_chat_template_needs_a_trusting_server(tiny_model_dir, client: httpx.Client) -> None:
    template = "{{ greeting }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template,
            "chat_template_kwargs": {"greeting": "Hey"}}
    assert_error(client.post("/tokenize", json=body), 400, "chat_template", code="unsupported")
    clash = {"messages": body["messages"], "chat_template_kwargs": {"messages": []}}
    assert_error(client.post("/tokenize", json=clash), 400, "chat_template_kwargs")
    app = build_app(lambda: tiny_engine(tiny_model_dir), model_names=[MODEL],
                    limits=ServerLimits(trust_request_chat_template=True))
    with BackgroundServer(app) as server:
        wait_healthy(server.base_url)
        tokens = httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"]
        expected = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hey[hi]"}).json()["tokens"]
        assert tokens == expected
        chat = httpx.post(f"{server.base_url}/v1/chat/completions",
                          json={**body, "max_tokens": 2, "temperature": 0}).json()
        assert chat["usage"]["prompt_tokens"] == len(expected)


def test_stop_token_id_is_named_and_eos_is_not(client: httpx.Client, offline: LLM) -> None:
    greedy = offline.generate("Hello there", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_id = greedy.token_ids[2]
    body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    cut = client.post("/v1/completions", json={**body, "stop_token_ids": [stop_id]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["stop_reason"] == stop_id
    [eos] = offline.tokenizer.eos_token_ids
    forced = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0,
                                                  "logit_bias": {str(eos): 100}}).json()["choices"][0]
    assert forced["finish_reason"] == "stop" and forced["stop_reason"] is None and forced["text"] == ""


def test_max_tokens_absent_is_16_for_completions_and_the_limit_for_chat(client: httpx.Client) -> None:
    data = client.post("/v1/completions", json={"prompt": "Hi", "temperature": 0, "ignore_eos": True}).json()
    assert data["usage"]["completion_tokens"] == 16  # OpenAI's and vLLM's default
    assert data["choices"][0]["finish_reason"] == "length"
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "temperature": 0, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == LIMITS.max_tokens


def test_completion_logprobs_in_the_legacy_format(client: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 3}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 6
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                   strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert top[token] == logprob
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the best


# Byte-level pieces of the tiny tokenizer that are parts of CJK characters: "\xe4" "\xbd" "\xa0"
# make 你, "\xe5" "\xa5" "\xbd" make 好; none is a whole character.
PARTIAL_PIECES = {b"\xe4", b"\xbd", b"\xa0", b"\xe5", b"\xa5", b"\xb8", b"\xad"}


def _legacy_token_bytes(name: str) -> bytes:
    """A legacy-format token name back to its bytes: "bytes:\\xNN..." or the text itself."""
    if name.startswith("bytes:"):
        hex_digits = name.removeprefix("bytes:").split("\\x")
        assert hex_digits[0] == "", name
        return bytes(int(pair, 16) for pair in hex_digits[1:])
    return name.encode()


def _check_legacy_logprobs(logprobs: dict, text: str, top_n: int) -> None:
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert all("\ufffd" not in token for token in tokens)
    for token, logprob, top in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert len(top) in (top_n, top_n + 1) and top[token] == logprob
    assert offsets == sorted(offsets) and all(0 <= offset <= len(text) for offset in offsets)
    assert b"".join(_legacy_token_bytes(token) for token in tokens).decode("utf-8", errors="replace") == text


def test_completion_logprobs_name_partial_characters_by_their_bytes(client: httpx.Client,
                                                                    offline: LLM) -> None:
    tokenizer = offline.tokenizer
    partial = [i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) in PARTIAL_PIECES]
    assert len(partial) == len(PARTIAL_PIECES)
    # The bias makes the model emit only partial characters (logprobs are reported unbiased, so
    # the chosen token may be a sixth top entry); each used to be named "\ufffd", merging keys.
    body = {"prompt": "中文: 你好，世界。我的名字是", "max_tokens": 8, "temperature": 0, "logprobs": 5,
            "logit_bias": {str(i): 50 for i in partial}}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert all(token.startswith("bytes:") for token in logprobs["tokens"])
    assert any(sum(key.startswith("bytes:") for key in top) >= 2 for top in logprobs["top_logprobs"])
    _check_legacy_logprobs(logprobs, choice["text"], 5)

    chunks = chunks_of(client.post("/v1/completions", json={**body, "stream": True}))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for lp in streamed for t in lp["tokens"]] == logprobs["tokens"]
    assert [o for lp in streamed for o in lp["text_offset"]] == logprobs["text_offset"]


def test_completion_logprobs_offsets_count_whole_characters(offline: LLM) -> None:
    tokenizer = offline.tokenizer
    names = TokenText(tokenizer)
    ids = tokenizer.encode("A你好，🚀!", add_bos=False)
    by_bytes = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    entries = [TokenLogprob(i, -1.0, ((i, -1.0), (by_bytes[b"\xb8"], -2.0), (by_bytes[b"\xad"], -3.0)))
               for i in ids]
    offset = TextOffset()
    half = len(entries) // 2
    first = completion_logprobs(entries[:half], names, offset)
    second = completion_logprobs(entries[half:], names, offset)  # a stream's next chunk
    whole = completion_logprobs(entries, names)
    assert first["tokens"] + second["tokens"] == whole["tokens"]
    assert first["text_offset"] + second["text_offset"] == whole["text_offset"]
    text = "A你好，🚀!"
    _check_legacy_logprobs(whole, text, 3)
    # Each token starts after the characters completed before it; a partial one adds none.
    expected, done = [], b""
    for i in ids:
        expected.append(len(done.decode("utf-8", errors="ignore")))
        done += tokenizer.token_bytes(i)
    assert whole["text_offset"] == expected and offset.chars == len(text)
    assert whole["tokens"][1] == "bytes:\\xe4" and whole["top_logprobs"][1] == {
        "bytes:\\xe4": -1.0, "bytes:\\xb8": -2.0, "bytes:\\xad": -3.0}
    assert "bytes:\\xf0\\x9f" in whole["tokens"]  # 🚀's first piece: two bytes of four


def test_completion_logprobs_keep_one_entry_per_name(offline: LLM) -> None:
    names = TokenText(offline.tokenizer)
    [token_id] = offline.tokenizer.encode("A", add_bos=False)
    other = offline.tokenizer.encode("B", add_bos=False)[0]
    entry = TokenLogprob(token_id, -0.5, ((other, -0.25), (other, -0.75), (token_id, -2.0)))
    logprobs = completion_logprobs([entry], names)
    assert logprobs["top_logprobs"] == [{"B": -0.25, "A": -0.5}] and logprobs["token_logprobs"] == [-0.5]


# -- chat -----------------------------------------------------------------------------------------

def test_unary_chat_uses_the_chat_template(client: httpx.Client, offline: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_completion_tokens": 10, "temperature": 0})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    [choice] = data["choices"]
    prompt = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(messages), add_bos=False)
    expected = offline.generate(prompt, SamplingParams(max_tokens=10, temperature=0))[0]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == expected.finish_reason
    assert data["usage"]["prompt_tokens"] == len(prompt)


def test_chat_text_content_parts_are_joined(client: httpx.Client) -> None:
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo!"}]
    plain = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 6, "temperature": 0}
    split = {**plain, "messages": [{"role": "user", "content": parts}]}
    assert (client.post("/v1/chat/completions", json=plain).json()["choices"]
            == client.post("/v1/chat/completions", json=split).json()["choices"])


def test_chat_logprobs_name_tokens_with_bytes(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert all(0 <= b < 256 for b in entry["bytes"])
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    assert joined.decode("utf-8", errors="replace") == choice["message"]["content"]


# -- streaming ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_outputs_taken_in_one_batch_still_finish_on_their_last_chunk_only(client, path, monkeypatch):
    """Under load the stream takes several outputs of a choice at once (the choice has then
    recorded the last of them): only the chunk of the finishing output may carry the finish."""
    from nanoserve.server import generation

    take_all = generation.Generation.next_outputs

    async def late(self):  # let the whole answer queue up before taking any of it
        while not self.queue.qsize() or not any(
                getattr(item, "finished", True) for item in list(self.queue._queue)):
            await asyncio.sleep(0.01)
        return await take_all(self)

    monkeypatch.setattr(generation.Generation, "next_outputs", late)
    body = {"max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True}
    body |= ({"messages": [{"role": "user", "content": "Once upon a time"}]} if "chat" in path
             else {"prompt": "Once upon a time"})
    choices = [c["choices"][0] for c in chunks_of(client.post(path, json=body)) if c["choices"]]
    assert [c["finish_reason"] for c in choices][-1] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1]), [c["finish_reason"] for c in choices]


def test_streamed_completion_equals_unary_and_ends_with_usage(client: httpx.Client) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    unary = client.post("/v1/completions", json=body).json()
    streamed = client.post("/v1/completions", json={**body, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = chunks_of(streamed)
    *content, last = chunks
    assert last["choices"] == [] and last["usage"] == unary["usage"]
    assert all(chunk["usage"] is None and chunk["object"] == "text_completion" for chunk in content)
    assert "".join(c["choices"][0]["text"] for c in content) == unary["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])


def test_streamed_chat_starts_with_the_role_and_carries_n_choices(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 2, "seed": 3,
            "temperature": 0.9, "stream": True}
    chunks = chunks_of(client.post("/v1/chat/completions", json=body))
    assert all(chunk["object"] == "chat.completion.chunk" and "usage" not in chunk for chunk in chunks)
    assert {c["choices"][0]["index"]: c["choices"][0]["delta"] for c in chunks[:2]} == {
        0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in chunks[2:]:
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert set(finish) == {0, 1}
    unary = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert [c["message"]["content"] for c in unary["choices"]] == [texts[0], texts[1]]


def test_a_stream_waiting_for_its_first_token_gets_keep_alive_comments(tiny_model_dir) -> None:
    with held_server(lambda: tiny_engine(tiny_model_dir), sse_keep_alive_s=0.05) as (served, gate):
        body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=30) as response:
            lines = (line for line in response.iter_lines() if line)
            assert [next(lines), next(lines)] == [": keep-alive", ": keep-alive"]  # steps are held
            gate.set()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and all(line.startswith(("data: ", ":")) for line in rest)
        wait_idle(served)


def test_streamed_logprobs_offsets_continue_across_chunks(client: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 1, "stream": True}
    chunks = chunks_of(client.post("/v1/completions", json=body))
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 6
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(6)]


# -- /tokenize and /detokenize ----------------------------------------------------------------------

def test_tokenize_and_detokenize_round_trip_a_prompt(served: Served, client: httpx.Client) -> None:
    tokens = client.post("/tokenize", json={"prompt": "Hello there"}).json()
    assert tokens["tokens"] == served.engine.tokenizer.encode("Hello there")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == served.engine.max_model_len
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": served.engine.tokenizer.decode(tokens["tokens"])}


def test_tokenize_messages_uses_the_chat_template(served: Served, client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == served.engine.tokenizer.encode_chat(messages)


def test_chat_template_flags_reach_the_template(served: Served, client: httpx.Client) -> None:
    """vLLM's add_generation_prompt / continue_final_message, on /tokenize and chat completions."""
    tokenizer = served.engine.tokenizer
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = client.post("/tokenize", json={"messages": messages, **flags}).json()["tokens"]
    assert tokens == tokenizer.encode_chat(messages, **flags)
    assert tokens != tokenizer.encode_chat(messages)
    body = {"messages": messages, **flags, "max_tokens": 1, "temperature": 0}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == len(tokens)
    both = {"messages": messages, "continue_final_message": True, "max_tokens": 1}
    assert_error(client.post("/v1/chat/completions", json=both), 400, "continue_final_message")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens[1]"),
])
def test_tokenize_and_detokenize_refuse_bad_input_naming_the_field(client: httpx.Client, path: str,
                                                                     body: dict, param: str) -> None:
    assert_error(client.post(path, json=body), 404 if param == "model" else 400, param)


# -- disconnects ----------------------------------------------------------------------------------

def test_a_client_hanging_up_mid_stream_frees_its_blocks(served: Served, client: httpx.Client) -> None:
    engine = served.engine
    before = engine.stats.generation_tokens
    body = {"prompt": "Hello", "max_tokens": LIMITS.max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    step = engine.step
    engine.step = lambda: time.sleep(0.02) or step()  # 48 tokens take a second; hanging up takes less
    try:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        wait_idle(served)
    finally:
        engine.step = step
    assert engine.stats.generation_tokens - before < LIMITS.max_tokens


def test_a_client_hanging_up_on_a_unary_request_frees_its_blocks(tiny_model_dir) -> None:
    with held_server(lambda: tiny_engine(tiny_model_dir)) as (served, gate):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{served.base_url}/v1/completions", timeout=0.5,
                       json={"prompt": "Hi", "max_tokens": 200, "ignore_eos": True})
        gate.set()
        wait_idle(served)
        assert served.engine.stats.generation_tokens < 200
        assert finished_count(httpx.get(f"{served.base_url}/metrics").text, "abort") == 1


def finished_count(metrics: str, reason: str) -> int:
    prefix = "nanoserve_request_success_total{"
    (line,) = [line for line in metrics.splitlines()
               if line.startswith(prefix) and f'finished_reason="{reason}"' in line]
    return int(float(line.rsplit(" ", 1)[1]))


def test_a_hang_up_mid_stream_counts_one_abort_per_sequence(served: Served, client: httpx.Client) -> None:
    before = finished_count(client.get("/metrics").text, "abort")
    engine = served.engine
    step = engine.step
    engine.step = lambda: time.sleep(0.02) or step()  # 40 tokens take a second; hanging up takes less
    try:
        body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True, "n": 2}
        with client.stream("POST", "/v1/completions", json=body) as response:
            next(response.iter_lines())
        wait_idle(served)
    finally:
        engine.step = step
    assert finished_count(client.get("/metrics").text, "abort") == before + 2


def send_part_of_a_body(base_url: str) -> socket.socket:
    """A connection that has sent its headers and 10 of the 100 body bytes it declared."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=10)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n" + b'{"prompt":')
    return conn


def test_a_body_that_stalls_is_answered_408_within_the_body_timeout(served: Served) -> None:
    with send_part_of_a_body(served.base_url) as conn:
        started = time.monotonic()
        answer = b"".join(iter(lambda: conn.recv(4096), b"")).decode()  # until the server closes
    assert answer.startswith("HTTP/1.1 408"), answer
    assert '"param":"body"' in answer and "request_timeout" in answer
    assert time.monotonic() - started < LIMITS.body_timeout_s + 2


def test_connections_that_send_no_request_head_are_closed_after_the_header_timeout(tiny_model_dir) -> None:
    app = build_app(lambda: tiny_engine(tiny_model_dir), model_names=[MODEL])
    with BackgroundServer(app, header_timeout_s=0.5) as server:
        wait_healthy(server.base_url)
        host, port = server.base_url.removeprefix("http://").split(":")
        silent, partial = (socket.create_connection((host, int(port))) for _ in range(2))
        partial.sendall(b"GET /health HT")  # half a request line, then nothing
        for sock in (silent, partial):
            sock.settimeout(10)  # bounded: a server that never closes fails here, not hangs
            start = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the server
            assert time.monotonic() - start < 5
            sock.close()
        with httpx.Client(base_url=server.base_url) as http:  # keep-alive: the deadline re-arms
            assert http.get("/health").status_code == 200
            assert http.get("/health").status_code == 200


def test_a_long_prefill_logs_its_progress(tiny_model_dir, caplog: pytest.LogCaptureFixture) -> None:
    app = build_app(lambda: tiny_engine(tiny_model_dir, max_num_batched_tokens=16), model_names=[MODEL],
                    prefill_log_s=0.0)
    with caplog.at_level(logging.INFO, logger="nanoserve.server"), BackgroundServer(app) as server:
        wait_healthy(server.base_url)
        body = {"prompt": [7] * 100, "max_tokens": 1, "temperature": 0}
        assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "prefill" in r.getMessage()]
    assert any("prefilled 16 of 100 prompt tokens (16%)" in line for line in lines), lines
    assert any("prefill of 100 prompt tokens done" in line for line in lines), lines


def test_a_hang_up_while_sending_the_body_logs_one_line_and_no_traceback(
        served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nanoserve.server")
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's own loggers do not reach the root
    uvicorn_log.addHandler(caplog.handler)
    try:
        send_part_of_a_body(served.base_url).close()
        deadline = time.monotonic() + 5
        while not any("hung up" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # anything logged after the line would show up here
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    hang_ups = [r for r in caplog.records if "hung up while sending its body" in r.getMessage()]
    assert len(hang_ups) == 1 and hang_ups[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# -- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "n": LIMITS.max_n + 1}, "n"),
    ({"prompt": "x", "max_tokens": LIMITS.max_tokens + 1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"prompt": "x", "stop": ["x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)]}, "stop"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "typical_p": 0}, "typical_p"),
    ({"prompt": "x", "typical_p": 1.5}, "typical_p"),
    ({"prompt": "x", "top_n_sigma": 0}, "top_n_sigma"),
    ({"prompt": "x", "top_n_sigma": -2}, "top_n_sigma"),
    ({"prompt": "x", "dry_multiplier": -1}, "dry_multiplier"),
    ({"prompt": "x", "dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ({"prompt": "x", "xtc_probability": 2}, "xtc_probability"),
    ({"prompt": "x", "mirostat": 3}, "mirostat"),
    ({"prompt": "x", "mirostat": 2, "top_k": 40}, "top_k"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "echo": True, "logprobs": 2, "stream": True}, "echo"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "chat_template": "{{ 1 }}"}, "chat_template"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": [5, 99999]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": ["a"] * (LIMITS.max_prompts + 1)}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
])
def test_completion_validation_failures_are_400_naming_the_field(served: Served, client: httpx.Client,
                                                                  body: dict, param: str) -> None:
    steps = served.engine.stats.steps
    assert_error(client.post("/v1/completions", json=body), 400, param)
    assert served.engine.stats.steps == steps  # refused before any engine work


@pytest.mark.parametrize(("body", "param"), [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "hi"}]},
     "messages[1].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1, " 5": 2}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {str(i): 1 for i in range(1025)}},
     "logit_bias"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),  # a text-only model: the image part
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "typical_p": -0.1}, "typical_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_n_sigma": "wide"}, "top_n_sigma"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "response_format.type"),
])
def test_chat_validation_failures_are_400_naming_the_field(client: httpx.Client, body: dict,
                                                           param: str) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_json_and_non_object_bodies_are_400(client: httpx.Client) -> None:
    for raw in (b"{bad", b"", b"[1, 2]", b'"prompt"', b"\xff\xfe"):
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert_error(client.post(path, content=raw), 400, "body")


def test_context_overflow_is_400_before_engine_work(served: Served, client: httpx.Client) -> None:
    steps = served.engine.stats.steps
    limit = served.engine.scheduler.max_request_tokens
    long_prompt = [5] * limit
    assert_error(client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}), 400, "prompt")
    near = [5] * (limit - 4)
    assert_error(client.post("/v1/completions", json={"prompt": near, "max_tokens": 8}), 400, "max_tokens")
    assert served.engine.stats.steps == steps


def test_unknown_fields_are_400_naming_them_with_a_suggestion(client: httpx.Client) -> None:
    error = assert_error(client.post("/v1/completions", json={"prompt": "Hi", "temprature": 0.5}), 400,
                         "temprature", code="unknown_field")
    assert "'temperature'" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi", "colour": "red"}]}
    assert_error(client.post("/v1/chat/completions", json=chat), 400, "messages[0].colour",
                 code="unknown_field")


def test_harmless_values_of_refused_fields_are_accepted(client: httpx.Client) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "user": "me", "metadata": None, "best_of": 1, "echo": False,
            "suffix": None, "priority": 0, "use_beam_search": False}
    assert client.post("/v1/completions", json=body).status_code == 200


def test_unknown_model_is_404(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions",
                           json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    error = assert_error(response, 404, "model", code="model_not_found")
    assert "gpt-9" in error["message"]


def test_oversized_body_is_413(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": "x" * (LIMITS.max_body_bytes + 1)})
    assert_error(response, 413, "body")


def test_a_trailing_slash_is_served_not_redirected(client: httpx.Client) -> None:
    response = client.post("/v1/completions/", json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert client.get("/metrics/").status_code == 200
    assert client.get("/v1/models/").status_code == 200


def test_unknown_route_and_wrong_method_keep_the_error_shape(client: httpx.Client) -> None:
    assert_error(client.get("/v1/nothing"), 404, None)
    assert_error(client.get("/v1/completions"), 405, None)


def test_over_the_queue_limit_is_503_with_retry_after(tiny_model_dir) -> None:
    limits = ServerLimits(max_waiting=0, max_tokens=400)
    with held_server(lambda: tiny_engine(tiny_model_dir, max_num_seqs=1), limits=limits) as (served, gate):
        body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=30):
            second = httpx.post(f"{served.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert_error(second, 503, None)
            assert second.headers["retry-after"] == "1"
            gate.set()
        wait_idle(served)
        assert httpx.post(f"{served.base_url}/v1/completions",
                          json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
        never_fits = httpx.post(f"{served.base_url}/v1/completions", json={"prompt": "Hi", "n": 2})
        assert_error(never_fits, 400, "n")


def test_drain_refuses_new_work_and_ends_what_is_left_with_an_error_event(tiny_model_dir) -> None:
    with held_server(lambda: tiny_engine(tiny_model_dir)) as (served, gate):
        body = {"prompt": "Hi", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=30) as response:
            while served.async_engine.num_in_flight == 0:
                time.sleep(0.01)
            start_drain(served.app, 0.2)
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert events[-1] == "[DONE]"
        assert "shutting down" in json.loads(events[-2])["error"]["message"]
        assert httpx.get(f"{served.base_url}/health").json() == {"status": "draining"}
        assert_error(httpx.post(f"{served.base_url}/v1/completions", json={"prompt": "a"}), 503, None)
        gate.set()
        wait_idle(served)


def test_an_engine_error_mid_stream_is_an_error_event_then_done(tiny_model_dir) -> None:
    app = build_app(lambda: tiny_engine(tiny_model_dir), model_names=[MODEL])
    with BackgroundServer(app) as server:
        wait_healthy(server.base_url)
        engine = app.state.server.async_engine.engine
        step = engine.step
        calls = {"n": 0}

        def failing_step():
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("boom")
            return step()

        engine.step = failing_step
        # Greedy: an unseeded sampled request could draw three tokens whose text is empty (a
        # random tiny model's byte pieces), and then no token event comes before the error.
        body = {"prompt": "Hi", "max_tokens": 20, "ignore_eos": True, "stream": True, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        events = events_of(response)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and "boom" in error["message"]
        assert len(events) >= 3  # some tokens came before the failure
        assert httpx.get(f"{server.base_url}/health").status_code == 503
        assert_error(httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "a"}), 503, None)


# -- the online bench client ----------------------------------------------------------------------

def test_bench_client_counts_every_streamed_token(served: Served) -> None:
    import asyncio

    from nanoserve.bench.serve import Workload, run_clients, summarize

    prompts = Workload(num_prompts=6, input_len=4, output_len=5, seed=1).prompts()
    results, duration_s = asyncio.run(run_clients(served.base_url, MODEL, prompts, 5, max_concurrency=3))
    metrics = summarize(results, duration_s)
    assert metrics["completed"] == 6 and metrics["failed"] == 0
    assert metrics["total_output_tokens"] == 30
    assert all(len(r.itl_s) <= 4 for r in results)
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "median_e2el_ms", "output_throughput",
                "request_throughput"):
        assert metrics[key] > 0, key
    wait_idle(served)


def test_a_server_seed_makes_unseeded_requests_reproduce_across_restarts(tiny_model_dir) -> None:
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 1.5, "ignore_eos": True, "n": 2}

    def texts_from_a_fresh_server(seed: int) -> list[list[str]]:
        app = build_app(lambda: tiny_engine(tiny_model_dir), model_names=[MODEL], seed=seed)
        with BackgroundServer(app) as server:
            wait_healthy(server.base_url)
            url = f"{server.base_url}/v1/completions"
            return [[c["text"] for c in httpx.post(url, json=body, timeout=30).json()["choices"]]
                    for _ in range(3)]

    first = texts_from_a_fresh_server(7)
    assert texts_from_a_fresh_server(7) == first
    assert len({text for texts in first for text in texts}) > 1  # each request and choice its own seed
