"""LoRA adapters over HTTP, as vLLM serves them, driven by the official openai client over
loopback: a request picks an adapter by `model` on completions, chat completions, Messages and
Responses and gets the tokens the offline engine gives with that adapter; /v1/models lists each
with its parent and root; vLLM's load/unload routes answer 404 unless turned on, refuse bad
adapters by name with nothing loaded, and an adapter unloaded under a running stream finishes
that stream unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import BackgroundServer
from test_lora import build_adapter
from test_server_api import Served, tiny_engine, wait_healthy, wait_idle
from typer.testing import CliRunner

from nanoserve import LoRARequest
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.adapters import LoRAModule, parse_lora_module
from nanoserve.server.app import build_app
from nanoserve_cli.main import app as cli

openai = pytest.importorskip("openai")
pytest.importorskip("peft", reason="peft (the dev extra) builds the adapters")

MODEL = "tiny"
PROMPT = "Once upon a time, in a small village"
MESSAGES = [{"role": "user", "content": "Tell me a story about a baker."}]
ENGINE = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("server_adapters")
    return [build_adapter(tiny_model_dir, root / f"a{i}", seed=10 + i) for i in range(3)]


@contextlib.contextmanager
def serving(model_dir: Path, modules: tuple[LoRAModule, ...] = (), **app_options) -> Iterator[Served]:
    app = build_app(lambda: tiny_engine(model_dir, **ENGINE), model_names=[MODEL], lora_modules=modules,
                    **app_options)
    with BackgroundServer(app) as server:
        wait_healthy(server.base_url)
        yield Served(server.base_url, app)


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)


def modules_of(adapters: list[Path]) -> tuple[LoRAModule, ...]:
    return (LoRAModule("a0", str(adapters[0])), LoRAModule("a1", str(adapters[1]), base_model_name="base-x"))


def test_a_completion_picks_its_adapter_by_model_and_gets_the_offline_engines_tokens(tiny_model_dir,
                                                                                      adapters):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=96, **ENGINE)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    with serving(tiny_model_dir, modules_of(adapters)) as served:
        for model, lora in (("a0", LoRARequest("a0", 1, str(adapters[0]))),
                            ("a1", LoRARequest("a1", 2, str(adapters[1]))), (MODEL, None)):
            got = client(served).completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                                    logprobs=0, extra_body={"ignore_eos": True})
            expected = llm.generate([PROMPT], params, lora_request=lora)[0]
            assert got.model == model
            assert got.choices[0].text == expected.outputs[0].text
            assert got.choices[0].logprobs.token_logprobs == [e.logprob for e in expected.outputs[0].logprobs]
        wait_idle(served)


def test_chat_messages_and_responses_route_by_model_too(tiny_model_dir, adapters):
    with serving(tiny_model_dir, modules_of(adapters)) as served:
        openai_client = client(served)

        def chat(model: str) -> str:
            reply = openai_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10,
                                                          temperature=0)
            return reply.choices[0].message.content

        by_model = {model: chat(model) for model in ("a0", "a1", MODEL)}
        assert len(set(by_model.values())) == 3, "the adapters do not change the greedy text"
        for model, text in by_model.items():
            response = openai_client.responses.create(model=model, input=MESSAGES, max_output_tokens=10,
                                                      temperature=0)
            assert response.output_text == text
            message = httpx.post(f"{served.base_url}/v1/messages", json={
                "model": model, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}).json()
            assert message["content"][0]["text"] == text
        with pytest.raises(openai.NotFoundError) as error:
            chat("a2")
        assert error.value.body["param"] == "model"
        wait_idle(served)


def test_models_lists_each_adapter_with_its_parent_and_root(tiny_model_dir, adapters):
    with serving(tiny_model_dir, modules_of(adapters)) as served:
        listed = {m.id: m for m in client(served).models.list().data}
        assert set(listed) == {MODEL, "a0", "a1"}
        assert listed[MODEL].parent is None
        assert (listed["a0"].parent, listed["a0"].root) == (MODEL, str(adapters[0]))
        assert (listed["a1"].parent, listed["a1"].root) == ("base-x", str(adapters[1]))
        assert client(served).models.retrieve("a1").root == str(adapters[1])


def test_the_runtime_routes_answer_404_naming_the_flag_unless_it_is_on(tiny_model_dir, adapters):
    with serving(tiny_model_dir) as served:
        for route, body in (("load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters[0])}),
                            ("unload_lora_adapter", {"lora_name": "x"})):
            answer = httpx.post(f"{served.base_url}/v1/{route}", json=body)
            assert answer.status_code == 404
            assert "--enable-lora-runtime-updates" in answer.json()["error"]["message"]
        assert served.engine.list_loras() == []


def post(served: Served, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.base_url}/v1/{route}", json=body, timeout=60)


def test_bad_runtime_loads_are_400s_naming_the_field_and_load_nothing(tiny_model_dir, adapters, tmp_path):
    wide = build_adapter(tiny_model_dir, tmp_path / "wide", seed=5, rank=16)
    with serving(tiny_model_dir, modules_of(adapters)[:1], lora_runtime_updates=True) as served:
        cases = [({"lora_name": "x", "lora_path": str(tmp_path)}, "lora_path", "not a PEFT adapter folder"),
                 ({"lora_name": "x", "lora_path": str(wide)}, "lora_path", "max_lora_rank=8"),
                 ({"lora_name": MODEL, "lora_path": str(adapters[1])}, "lora_name", "base model"),
                 ({"lora_name": "a0", "lora_path": str(adapters[1])}, "lora_name", "already been loaded"),
                 ({"lora_name": "x", "lora_path": str(adapters[1]), "load_inplace": True}, "load_inplace",
                  "not supported"),
                 ({"lora_name": "x"}, "lora_path", "")]
        for body, param, says in cases:
            answer = post(served, "load_lora_adapter", body)
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["error"]["param"] == param and says in answer.json()["error"]["message"]
            assert [a.name for a in served.engine.list_loras()] == ["a0"], "a refused adapter stayed loaded"
        assert post(served, "unload_lora_adapter", {"lora_name": "nope"}).status_code == 404


def test_adapters_load_and_unload_at_run_time_beyond_max_loras(tiny_model_dir, adapters):
    with serving(tiny_model_dir, lora_runtime_updates=True) as served:
        for i in range(4):  # max_loras=3: the fourth is served too, sharing steps with at most two others
            body = {"lora_name": f"r{i}", "lora_path": str(adapters[i % 3])}
            answer = post(served, "load_lora_adapter", body)
            assert answer.status_code == 200, answer.text
        assert {m.id for m in client(served).models.list().data} == {MODEL, "r0", "r1", "r2", "r3"}
        assert client(served).completions.create(model="r2", prompt=PROMPT, max_tokens=4).choices[0].text
        assert post(served, "unload_lora_adapter", {"lora_name": "r2"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            client(served).completions.create(model="r2", prompt=PROMPT, max_tokens=4)
        assert [a.name for a in served.engine.list_loras()] == ["r0", "r1", "r3"]
        wait_idle(served)


def test_an_adapter_unloaded_under_a_running_stream_finishes_that_stream_unchanged(tiny_model_dir, adapters):
    with serving(tiny_model_dir, modules_of(adapters)[:1], lora_runtime_updates=True) as served:
        openai_client = client(served)
        request = {"model": "a0", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                   "extra_body": {"ignore_eos": True}}
        expected = openai_client.completions.create(**request).choices[0].text
        stream = openai_client.completions.create(stream=True, **request)
        pieces = [next(iter(stream)).choices[0].text]
        assert post(served, "unload_lora_adapter", {"lora_name": "a0"}).status_code == 200
        pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert "".join(pieces) == expected
        assert served.engine.list_loras() == []
        wait_idle(served)


@pytest.mark.parametrize(("text", "module"), [
    ("a=/x", LoRAModule("a", "/x")),
    ('{"name": "a", "path": "/x", "base_model_name": "b"}', LoRAModule("a", "/x", "b")),
])
def test_lora_modules_take_vllms_two_spellings(text, module):
    assert parse_lora_module(text) == module


def test_bad_lora_modules_exit_2_naming_the_option_before_the_model_loads(tiny_model_dir, adapters, tmp_path):
    wide = build_adapter(tiny_model_dir, tmp_path / "wide", seed=5, rank=16)
    runner = CliRunner()
    for args, says in ((["--lora-modules", "nopath"], "name=path"),
                       (["--lora-modules", '{"name": "a"}'], "name=path"),
                       (["--lora-modules", f"a={tmp_path}"], "not a PEFT adapter folder"),
                       (["--lora-modules", f"a={wide}", "--max-lora-rank", "8"], "max_lora_rank=8"),
                       (["--lora-modules", f"tiny={adapters[0]}", "--served-model-name", "tiny"],
                        "base model"),
                       (["--lora-modules", f"a={adapters[0]}", "--lora-modules", f"a={adapters[1]}"],
                        "more than once")):
        result = runner.invoke(cli, ["serve", "--model", str(tiny_model_dir), *args])
        assert result.exit_code == 2, result.output
        assert "--lora-modules" in result.output and says in " ".join(result.output.split())
        assert "Traceback" not in result.output
