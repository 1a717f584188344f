"""Several models in one server (`serve --models-dir`, `--model` repeated): each request's `model`
picks its engine, models load on their first request and unload when idle or to make room, and
`/v1/models` says which are loaded.

Two tiny random models with different weights, one a Hugging Face folder and one a GGUF file,
served from one directory the way `nanoserve serve --models-dir` builds them (`_model_specs`),
on a real loopback socket in this process (`BackgroundServer`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from server_harness import BackgroundServer
from test_serve_signals import free_port, health, wait_until
from test_server_api import hold_engine_steps
from tiny_model import write_tiny_gguf, write_tiny_llama
from typer.testing import CliRunner

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.server.app import ModelPolicy, build_app
from nanoserve.server.bridges.engine_bridge import EngineUnavailableError
from nanoserve.server.bridges.models import ModelNotServedError, ModelRegistry, ModelSpec
from nanoserve_cli.main import app as cli_app
from nanoserve_cli.options import EngineOptions
from nanoserve_cli.serve import _model_specs

KV_CACHE_GB = 0.02  # the server's whole KV budget: split between the models loaded at once
ENGINE = EngineOptions(kv_cache_gb=KV_CACHE_GB, max_num_seqs=4)
NAMES = ("alpha", "beta")  # alpha: an HF folder; beta: a GGUF file (served as its file stem)
REQUEST = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 2}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_tiny_llama(root / "alpha", seed=1)
    write_tiny_gguf(root / "beta.gguf", write_tiny_llama(tmp_path_factory.mktemp("beta_hf"), seed=2))
    (root / "notes.txt").write_text("not a model")
    return root


@pytest.fixture(scope="module")
def alone(models_dir: Path) -> dict[str, dict]:
    """Each model's answer to REQUEST, served alone by a server of one model."""
    answers = {}
    for name, path in (("alpha", models_dir / "alpha"), ("beta", models_dir / "beta.gguf")):
        config = EngineConfig(model=str(path), kv_cache_gb=KV_CACHE_GB / 2, max_num_seqs=4)
        with serving(build_app(lambda config=config: Engine(config), model_names=[name])) as http:
            answers[name] = completion(http, name)
    assert answers["alpha"]["choices"][0]["logprobs"] != answers["beta"]["choices"][0]["logprobs"]
    return answers


@contextlib.contextmanager
def serving(app) -> Iterator[httpx.Client]:
    with BackgroundServer(app) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        deadline = time.monotonic() + 120
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.05)
        yield http


def several_app(models_dir: Path, **policy) -> FastAPI:
    """A server of every model in `models_dir`, as `serve --models-dir` builds it."""
    max_loaded = policy.setdefault("max_loaded", 2)
    specs = _model_specs([], models_dir, ENGINE, max_loaded)
    return build_app(models=specs, model_policy=ModelPolicy(**policy))


@contextlib.contextmanager
def several(models_dir: Path, **policy) -> Iterator[httpx.Client]:
    with serving(several_app(models_dir, **policy)) as http:
        yield http


def completion(http: httpx.Client, model: str | None, **fields) -> dict:
    response = http.post("/v1/completions", json={**REQUEST, "model": model, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def statuses(http: httpx.Client) -> dict[str, str]:
    return {card["id"]: card["status"] for card in http.get("/v1/models").json()["data"]}


def same_answer(got: dict, want: dict) -> bool:
    return got["choices"] == want["choices"] and got["usage"] == want["usage"]


def test_each_model_answers_as_it_does_served_alone(models_dir, alone):
    with several(models_dir) as http:
        assert statuses(http) == {"alpha": "available", "beta": "available"}
        for name in NAMES:
            answer = completion(http, name)
            assert answer["model"] == name
            assert same_answer(answer, alone[name]), name
        assert statuses(http) == {"alpha": "loaded", "beta": "loaded"}
        chat = http.post("/v1/chat/completions", json={
            "model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert chat.status_code == 200 and chat.json()["model"] == "beta"


def test_one_model_each_kv_budget_is_the_servers_split_between_the_models_loaded_at_once(models_dir):
    specs = _model_specs([], models_dir, ENGINE, 4)
    assert [spec.name for spec in specs] == list(NAMES)
    assert all(spec.build_engine.args[0].kv_cache_gb == KV_CACHE_GB / 2 for spec in specs)
    specs = _model_specs([], models_dir, ENGINE, 1)
    assert all(spec.build_engine.args[0].kv_cache_gb == KV_CACHE_GB for spec in specs)


def test_with_one_slot_a_request_for_the_other_model_loads_it_and_unloads_the_idle_one(models_dir, alone):
    with several(models_dir, max_loaded=1) as http:
        assert same_answer(completion(http, "alpha"), alone["alpha"])
        assert statuses(http) == {"alpha": "loaded", "beta": "available"}
        assert same_answer(completion(http, "beta"), alone["beta"])
        assert statuses(http) == {"alpha": "available", "beta": "loaded"}
        figures = http.get("/metrics").text
        assert 'nanoserve_engine_healthy{model_name="alpha"} 0.0' in figures
        assert 'nanoserve_engine_healthy{model_name="beta"} 1.0' in figures
        assert 'nanoserve_generation_tokens_total{model_name="beta"} 6.0' in figures
        assert same_answer(completion(http, "alpha"), alone["alpha"])
        assert statuses(http) == {"alpha": "loaded", "beta": "available"}


def test_no_request_is_lost_when_requests_for_both_models_crowd_one_slot(models_dir, alone):
    names = [NAMES[i % 2] for i in range(12)]
    with several(models_dir, max_loaded=1, wait_timeout_s=120) as http, \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda name: http.post("/v1/completions", json={**REQUEST, "model": name}),
                                names))
        assert [a.status_code for a in answers] == [200] * len(names), [a.text for a in answers]
        for name, answer in zip(names, answers, strict=True):
            assert same_answer(answer.json(), alone[name]), name


def test_a_model_with_a_request_in_flight_is_never_unloaded_the_other_waits_then_gets_503(models_dir):
    app = several_app(models_dir, max_loaded=1, wait_timeout_s=0.5)
    with serving(app) as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
        completion(http, "alpha")
        alpha = app.state.server.models.models["alpha"].bridge
        gate = hold_engine_steps(alpha.engine)
        streamed = {**REQUEST, "model": "alpha", "stream": True}
        running = pool.submit(http.post, "/v1/completions", json=streamed)
        deadline = time.monotonic() + 30
        while alpha.num_in_flight == 0:
            assert time.monotonic() < deadline, "alpha's request never started"
            time.sleep(0.01)
        refused = http.post("/v1/completions", json={**REQUEST, "model": "beta"})
        gate.set()
        assert running.result().status_code == 200
        assert running.result().text.rstrip().endswith("data: [DONE]")
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert "--max-loaded-models" in refused.json()["error"]["message"]
        assert statuses(http) == {"alpha": "loaded", "beta": "available"}
        completion(http, "beta")  # once alpha is idle, beta takes its slot


def test_an_idle_model_unloads_after_its_keep_alive(models_dir):
    with several(models_dir, idle_unload_s=0.0) as http:
        completion(http, "alpha")
        deadline = time.monotonic() + 30
        while statuses(http)["alpha"] != "available":
            assert time.monotonic() < deadline, "alpha was never unloaded"
            time.sleep(0.05)
    app = several_app(models_dir)
    with serving(app) as http:  # the default keeps it; a keep_alive of 0 (Ollama's) unloads it
        completion(http, "beta")
        registry = app.state.server.models
        assert statuses(http)["beta"] == "loaded"
        registry.loop.call_soon_threadsafe(registry.keep_alive, "beta", 0)
        deadline = time.monotonic() + 30
        while statuses(http)["beta"] != "available":
            assert time.monotonic() < deadline, "beta was never unloaded"
            time.sleep(0.05)


def test_an_unknown_model_is_404_and_none_named_is_400_in_openais_shape(models_dir):
    with several(models_dir) as http:
        unknown = http.post("/v1/completions", json={**REQUEST, "model": "gamma"})
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_found") and "gamma" in error["message"]
        assert http.get("/v1/models/gamma").status_code == 404
        assert http.get("/v1/models/beta").json()["status"] == "available"
        unnamed = http.post("/v1/completions", json=REQUEST)
        assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"
        assert statuses(http) == {"alpha": "available", "beta": "available"}  # nothing loaded for them


def test_a_model_that_fails_to_load_answers_503_and_the_others_still_serve(models_dir, tmp_path):
    (tmp_path / "alpha").symlink_to(models_dir / "alpha")
    shutil.copytree(models_dir / "alpha", tmp_path / "broken",
                    ignore=shutil.ignore_patterns("*.safetensors*"))
    with several(tmp_path) as http:
        failed = http.post("/v1/completions", json={**REQUEST, "model": "broken"})
        assert failed.status_code == 503
        assert "has no .safetensors weights" in failed.json()["error"]["message"]
        assert completion(http, "alpha")["model"] == "alpha"
        assert http.get("/health").status_code == 200
        assert statuses(http) == {"alpha": "loaded", "broken": "available"}


def test_the_official_openai_client_picks_models_by_name(models_dir, alone):
    with several(models_dir) as http, openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none",
                                                    max_retries=0) as client:
        assert sorted(model.id for model in client.models.list()) == list(NAMES)
        for name in NAMES:  # a stream first: its first byte comes once the model has loaded
            streamed = client.completions.create(model=name, stream=True, **REQUEST)
            assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == (
                alone[name]["choices"][0]["text"])
            answer = client.completions.create(model=name, **REQUEST)
            assert answer.model == name
            assert answer.choices[0].text == alone[name]["choices"][0]["text"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gamma", **REQUEST)


def test_serve_models_dir_as_a_process_serves_both_to_the_openai_client(models_dir, alone, tmp_path):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve",
               "--models-dir", str(models_dir), "--max-loaded-models", "1", "--kv-cache-gb", "0.01",
               "--max-num-seqs", "4", "--port", str(port), "--log-level", "warning"]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_until(lambda: health(base_url) == 200, "the server never became healthy", log_path)
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
            assert {model.id: model.model_extra["status"] for model in client.models.list()} == {
                "alpha": "available", "beta": "available"}
            for name in (*NAMES, "alpha"):
                answer = client.completions.create(model=name, **REQUEST)
                assert answer.choices[0].text == alone[name]["choices"][0]["text"], name
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


runner = CliRunner()


@pytest.mark.parametrize(("args", "says"), [
    (["--max-loaded-models", "0"], "--max-loaded-models"),
    (["--idle-unload-s", "-1"], "--idle-unload-s"),
    (["--idle-unload-s", "soon"], "--idle-unload-s"),
    (["--model-wait-timeout-s", "-1"], "--model-wait-timeout-s"),
    (["--models-dir", "{empty}"], "--models-dir"),
    (["--models-dir", "{missing}"], "--models-dir"),
    (["--models-dir", "{models}", "--served-model-name", "x"], "--served-model-name"),
    (["--models-dir", "{models}", "--enable-lora"], "--enable-lora"),
    (["--models-dir", "{models}", "--data-parallel-size", "2"], "--data-parallel-size"),
    (["--models-dir", "{models}", "--model", "{models}/alpha"], "two models are served as 'alpha'"),
    (["--model", "{models}/alpha", "--model", "{copy}/alpha"], "--model: two models are served as 'alpha'"),
    (["--model", "{models}/alpha", "--model", "{missing}"], "--model"),
    (["--model", "{models}/alpha", "--max-loaded-models", "2"], "--max-loaded-models"),
    (["--idle-unload-s", "off"], "--idle-unload-s"),  # one model (the default) is loaded for good
])
def test_a_bad_several_models_option_exits_2_naming_it_before_loading_any(args, says, models_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    shutil.copytree(models_dir / "alpha", tmp_path / "copy" / "alpha")
    paths = {"empty": tmp_path / "empty", "missing": tmp_path / "missing", "models": models_dir,
             "copy": tmp_path / "copy"}
    result = runner.invoke(cli_app, ["serve", *(arg.format(**paths) for arg in args)])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())
    assert "Traceback" not in result.output


# -- the registry alone, over bridges that load at once -----------------------------------------

class InstantBridge:
    """Ready one loop turn after `start`; counts how often it was stopped."""

    def __init__(self, on_ready) -> None:
        self.on_ready, self.ready, self.engine, self.stops = on_ready, False, None, 0

    def start(self) -> None:
        self.ready = True
        asyncio.get_running_loop().call_soon(self.on_ready)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self.stops += 1


def registry_of(names: str, **policy) -> ModelRegistry:
    specs = tuple(ModelSpec((name,), lambda: None) for name in names)
    return ModelRegistry(specs, ModelPolicy(**policy))


async def started(registry: ModelRegistry) -> ModelRegistry:
    registry.start(asyncio.get_running_loop(), lambda spec, on_ready, on_death: InstantBridge(on_ready))
    return registry


def loaded(registry: ModelRegistry) -> str:
    return "".join(sorted(name for name, model in registry.models.items() if model.bridge is not None))


def test_the_least_recently_used_idle_model_makes_room_never_one_in_flight():
    async def run() -> None:
        registry = await started(registry_of("abc", max_loaded=2, wait_timeout_s=0.05))
        for name in "aba":
            registry.release(await registry.acquire(name))
        assert loaded(registry) == "ab"
        registry.release(await registry.acquire("c"))  # b was used before a: b goes
        assert loaded(registry) == "ac"
        held = await registry.acquire("a")
        registry.release(await registry.acquire("b"))  # a is in flight: c goes
        assert loaded(registry) == "ab"
        other = await registry.acquire("b")
        with pytest.raises(EngineUnavailableError, match="--max-loaded-models"):
            await registry.acquire("c")  # both in flight: no room within the timeout
        assert loaded(registry) == "ab"
        registry.release(other)
        registry.release(await registry.acquire("c"))
        assert loaded(registry) == "ac" and held.bridge is not None
        registry.release(held)
        await registry.stop()

    asyncio.run(run())


def test_a_waiting_request_takes_the_slot_a_finished_request_frees():
    async def run() -> None:
        registry = await started(registry_of("ab", max_loaded=1, wait_timeout_s=30))
        held = await registry.acquire("a")
        waiting = asyncio.ensure_future(registry.acquire("b"))
        await asyncio.sleep(0.01)
        assert not waiting.done() and loaded(registry) == "a"
        registry.release(held)
        registry.release(await waiting)
        assert loaded(registry) == "b"
        await registry.stop()

    asyncio.run(run())


def test_keep_alive_overrides_the_idle_unload_for_its_model():
    async def run() -> None:
        registry = await started(registry_of("ab", idle_unload_s=0.0))
        registry.keep_alive("a", -1)  # Ollama's "keep it loaded"
        for name in "ab":
            registry.release(await registry.acquire(name))
        await asyncio.sleep(0.05)
        assert loaded(registry) == "a"
        registry.keep_alive("a", None)  # back to the server's: idle now, so it goes
        await asyncio.sleep(0.05)
        assert loaded(registry) == ""
        with pytest.raises(ModelNotServedError):
            registry.keep_alive("c", 0)
        await registry.stop()

    asyncio.run(run())


def test_a_keep_alive_holds_for_one_load_the_next_starts_from_the_servers():
    async def run() -> None:
        registry = await started(registry_of("a", idle_unload_s=30))
        registry.release(await registry.acquire("a"))
        registry.keep_alive("a", 0)
        await asyncio.sleep(0.05)
        assert loaded(registry) == ""
        registry.release(await registry.acquire("a"))
        await asyncio.sleep(0.05)
        assert loaded(registry) == "a" and registry.unloads_in_s(registry.models["a"]) > 29
        await registry.stop()

    asyncio.run(run())


def test_two_models_of_one_name_are_refused():
    with pytest.raises(ValueError, match="two models are served as 'a'"):
        registry_of("aa")
