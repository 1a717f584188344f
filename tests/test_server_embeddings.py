"""OpenAI's /v1/embeddings through the official client's `embeddings.create` over loopback:
float and base64 vectors equal to the offline engine's, every input shape, a 400 naming the
field for each bad body (before any engine step), the API key, and a server run with --task
embed refusing to generate. (The tenant's limit: tests/test_server_tenants.py walks every
generation endpoint, this one too.)"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from test_server_api import (
    Served,
    assert_error,
    idle_client,
    keyed_serving,
    openai_client,
    serving,
    tiny_engine,
)

from nanoserve.llm import LLM
from nanoserve.pooling_params import PoolingParams

KEY = "sk-embeddings"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["hello there friend", "a b c"]


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    with keyed_serving(tiny_model_dir, KEY) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai_client(served, KEY) as client:
        yield client


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=64)


def test_float_vectors_equal_the_offline_engines_and_usage_counts_the_prompts(client, offline) -> None:
    response = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    expected = offline.embed(TEXTS)
    assert [item.index for item in response.data] == [0, 1]
    assert [item.embedding for item in response.data] == [result.embedding for result in expected]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(
        len(result.prompt_token_ids) for result in expected)
    assert response.object == "list" and response.model == "tiny"


def test_base64_vectors_are_the_float_vectors_bytes(client) -> None:
    def embedding(**fields):
        return client.embeddings.create(model="tiny", input=TEXTS[0], **fields).data[0].embedding

    floats, encoded = embedding(encoding_format="float"), embedding(encoding_format="base64")
    assert isinstance(encoded, str)
    assert np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist() == floats
    # Without encoding_format the client asks for base64 itself and decodes it.
    assert embedding() == floats


def test_token_ids_and_lists_of_them_embed_as_their_text(client, offline) -> None:
    [first, second] = offline.embed(TEXTS)
    one = client.embeddings.create(model="tiny", input=first.prompt_token_ids, encoding_format="float")
    assert one.data[0].embedding == first.embedding
    both = client.embeddings.create(model="tiny", input=[first.prompt_token_ids, second.prompt_token_ids],
                                    encoding_format="float")
    assert [item.embedding for item in both.data] == [first.embedding, second.embedding]


def test_normalize_false_and_the_models_own_dimensions_are_honoured(served: Served, offline) -> None:
    hidden = served.engine.model_config.hidden_size
    with idle_client(served) as http:
        body = {"input": TEXTS[1], "normalize": False, "dimensions": hidden}
        vector = http.post("/v1/embeddings", headers=AUTH, json=body).json()["data"][0]["embedding"]
    assert vector == offline.embed(TEXTS[1], PoolingParams(normalize=False))[0].embedding
    assert abs(np.linalg.norm(vector) - 1) > 1e-3


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"input": []}, 400, "input", None),
    ({"input": ""}, 400, "input", None),
    ({"input": ["a", ""]}, 400, "input[1]", None),
    ({"input": [999999]}, 400, "input", None),
    ({"input": [[1, 2], [999999]]}, 400, "input[1]", None),
    ({"input": 3}, 400, "input", None),
    ({"input": "x", "encoding_format": "bytes"}, 400, "encoding_format", None),
    ({"input": "x", "dimensions": 3}, 400, "dimensions", None),
    ({"input": "x", "dimensions": 0}, 400, "dimensions", None),
    ({"input": "x", "normalize": "yes"}, 400, "normalize", None),
    ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", None),
    ({"input": "x", "embed_dtype": "float16"}, 400, "embed_dtype", "unsupported"),
    ({"input": "x", "request_id": "r"}, 400, "request_id", "unsupported"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "messages", "unsupported"),
    ({"input": "x", "encoding": "float"}, 400, "encoding", "unknown_field"),
    ({"input": "x", "model": "gpt-9"}, 404, "model", "model_not_found"),
])
def test_a_bad_body_is_refused_naming_the_field_before_any_step(served: Served, body, status, param,
                                                                 code) -> None:
    steps = served.engine.stats.steps
    with idle_client(served) as http:
        assert_error(http.post("/v1/embeddings", headers=AUTH, json=body), status, param, code)
    assert served.engine.stats.steps == steps


def test_the_api_key_is_required(served: Served) -> None:
    with idle_client(served) as http:
        assert http.post("/v1/embeddings", json={"input": "x"}).status_code == 401
    with (openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="wrong", max_retries=0) as wrong,
          pytest.raises(openai.AuthenticationError)):
        wrong.embeddings.create(model="tiny", input="x")


def test_an_embed_task_server_embeds_and_refuses_to_generate(tiny_model_dir) -> None:
    with serving(lambda: tiny_engine(tiny_model_dir, task="embed")) as served, idle_client(served) as http:
        assert http.post("/v1/embeddings", json={"input": "x"}).status_code == 200
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/responses", {"input": "x"})):
            error = assert_error(http.post(path, json=body), 400, "model", "unsupported")
            assert "--task embed" in error["message"]
        assert served.engine.stats.steps == 1
