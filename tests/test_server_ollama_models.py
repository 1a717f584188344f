"""Ollama's API over several models (`serve --models-dir`), through the official `ollama` client:
a request's `model` picks the model and loads it (the request waits; `load_duration` is that
wait), `keep_alive` sets when it unloads, Ollama's load and unload idioms, /api/tags lists every
model, /api/ps the loaded ones, and /api/show reads a model without loading it.

The server is tests/test_server_models.py's: two tiny random models with different weights, an
HF folder (alpha) and a GGUF file (beta), built the way `nanoserve serve --models-dir` builds
them, on a loopback socket in this process.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Iterator

import httpx
import ollama
import pytest
from test_server_models import NAMES, models_dir, serving, several_app, statuses  # noqa: F401 (a fixture)

HI = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "num_predict": 10}
# What GREEDY asks of the OpenAI endpoint (Ollama's defaults fill top_k and top_p).
OPENAI_GREEDY = {"temperature": 0, "top_k": 40, "top_p": 0.9, "max_tokens": 10}


@contextlib.contextmanager
def ollama_served(models_dir, **policy) -> Iterator[tuple[ollama.Client, httpx.Client]]:  # noqa: F811
    with serving(several_app(models_dir, **policy)) as http:
        yield ollama.Client(host=str(http.base_url)), http


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def running(client: ollama.Client) -> list[str]:
    return sorted(model.model for model in client.ps().models)


def test_the_client_lists_every_model_and_chats_with_each_as_the_openai_endpoint_answers(
        models_dir) -> None:  # noqa: F811
    with ollama_served(models_dir) as (client, http):
        listed = client.list().models
        assert [m.model for m in listed] == ["alpha:latest", "beta:latest"]
        assert [m.details.format for m in listed] == ["safetensors", "gguf"]
        assert all(m.details.family == "llama" and m.size > 0 for m in listed)
        assert running(client) == [] and set(statuses(http).values()) == {"available"}  # nothing loaded
        logprobs = {}
        for name in NAMES:
            reply = client.chat(model=name, messages=HI, options=GREEDY, logprobs=True)
            chat = http.post("/v1/chat/completions", json={"model": name, "messages": HI, "logprobs": True,
                                                            **OPENAI_GREEDY}).json()["choices"][0]
            assert reply.model == name and reply.message.content == chat["message"]["content"]
            logprobs[name] = [record.logprob for record in reply.logprobs]
            assert logprobs[name] == [record["logprob"] for record in chat["logprobs"]["content"]]
            assert reply.total_duration >= reply.load_duration > 0  # this request loaded it
            again = client.chat(model=f"{name}:latest", messages=HI, options=GREEDY)
            assert again.message.content == reply.message.content and again.load_duration == 0
        assert logprobs["alpha"] != logprobs["beta"]  # each answer is its own model's
        embedded = client.embed(model="beta:latest", input="Hello there").embeddings
        expected = http.post("/v1/embeddings", json={"model": "beta", "input": "Hello there"}).json()
        assert [list(vector) for vector in embedded] == [expected["data"][0]["embedding"]]
        loaded = client.ps().models
        assert sorted(m.model for m in loaded) == ["alpha:latest", "beta:latest"]
        now = dt.datetime.now(dt.UTC)
        for model in loaded:  # the server's --idle-unload-s, 300 s, once idle
            assert now < model.expires_at <= now + dt.timedelta(seconds=301)
            assert model.size_vram == 0 and model.context_length > 0


def test_keep_alive_0_unloads_and_a_streamed_generate_on_the_unloaded_model_loads_it(models_dir) -> None:  # noqa: F811
    with ollama_served(models_dir) as (client, _):
        whole = client.chat(model="alpha", messages=HI, options=GREEDY, keep_alive=0)
        until(lambda: running(client) == [], "alpha was never unloaded after keep_alive 0")
        parts = list(client.generate(model="alpha", prompt="Hello there", options=GREEDY, stream=True))
        assert "".join(part.response for part in parts) == whole.message.content  # the same chat
        assert parts[-1].done and parts[-1].load_duration > 0
        assert running(client) == ["alpha:latest"]


def test_ollamas_load_and_unload_idioms_load_and_unload_without_generating(models_dir) -> None:  # noqa: F811
    with ollama_served(models_dir) as (client, http):
        loaded = client.generate(model="beta")
        assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
        assert loaded.load_duration > 0 and running(client) == ["beta:latest"]
        unloaded = client.chat(model="beta", messages=[], keep_alive=0)
        assert (unloaded.done_reason, unloaded.message.content) == ("unload", "")
        until(lambda: running(client) == [], "beta was never unloaded")
        assert client.generate(model="alpha", keep_alive="0s").done_reason == "unload"
        assert set(statuses(http).values()) == {"available"}  # unloading loads nothing
        http.post("/v1/completions", json={"model": "beta", "prompt": "Hi", "max_tokens": 2})
        (reloaded,) = client.ps().models  # a keep-alive holds for one load: this one has the server's
        assert reloaded.expires_at > dt.datetime.now(dt.UTC) + dt.timedelta(seconds=200)


def test_keep_alive_sets_when_ps_says_the_model_unloads(models_dir) -> None:  # noqa: F811
    never_s = 2**63 / 1e9  # Ollama's "never": Go's longest duration
    with ollama_served(models_dir) as (client, _):
        for keep_alive, expires_in_s in (("1h30m", 5400), (90, 90), ("2.5m", 150), ("-1", never_s),
                                         (-5, never_s), (None, 300)):
            client.generate(model="alpha", prompt="Hi", options={"num_predict": 2}, keep_alive=keep_alive)
            expires_at = client.ps().models[0].expires_at
            expected = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=expires_in_s)
            assert abs((expires_at - expected).total_seconds()) < 60, keep_alive


@pytest.fixture(scope="module")
def idle(models_dir) -> Iterator[tuple[ollama.Client, httpx.Client]]:  # noqa: F811
    """A server whose requests load nothing."""
    with ollama_served(models_dir) as served:
        yield served
        assert set(statuses(served[1]).values()) == {"available"}


@pytest.mark.parametrize(("path", "payload"), [
    ("/api/chat", {"messages": HI}), ("/api/generate", {"prompt": "Hi"}), ("/api/embed", {"input": "Hi"})])
@pytest.mark.parametrize("keep_alive", ["forever", "5 minutes", "1d", "", "m5", True])
def test_a_bad_keep_alive_is_a_400_naming_it_and_loads_nothing(idle, path, payload, keep_alive) -> None:
    _, http = idle
    response = http.post(path, json={"model": "alpha", "keep_alive": keep_alive, **payload})
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"} and "keep_alive" in response.json()["error"]
    assert set(statuses(http).values()) == {"available"}


def test_an_unknown_model_is_ollamas_404_on_every_route(idle) -> None:
    client, http = idle
    for path, body in (("/api/chat", {"messages": HI}), ("/api/generate", {"prompt": "Hi"}),
                       ("/api/embed", {"input": "Hi"}), ("/api/show", {})):
        for name in ("gamma", "alpha:7b"):
            response = http.post(path, json={"model": name, **body})
            assert response.status_code == 404, (path, response.text)
            assert response.json() == {"error": f"model '{name}' not found"}
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="gamma", messages=HI)
    assert err.value.status_code == 404


def test_show_describes_a_model_not_loaded_without_loading_it_as_once_loaded(models_dir) -> None:  # noqa: F811
    with ollama_served(models_dir) as (client, http):
        unloaded = {name: client.show(name) for name in NAMES}
        assert set(statuses(http).values()) == {"available"}
        for name in NAMES:
            client.generate(model=name)  # load it
            assert client.show(f"{name}:latest") == unloaded[name], name
        assert "completion" in unloaded["beta"].capabilities and unloaded["beta"].template
        contexts = {m.model: m.context_length for m in client.ps().models}
        assert contexts == {f"{name}:latest": unloaded[name].modelinfo["llama.context_length"]
                            for name in NAMES}
