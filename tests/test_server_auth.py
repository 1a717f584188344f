"""The API key guards every route but the open ones, found by walking the app, not by a list.

A route moved out of the guarded routers (or added without the key) must fail this file: the
routes come from the app itself, its OpenAPI operations and its top-level routes, and only
`OPEN` (health, version, metrics and the API docs) may answer without the key.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from server_harness import BackgroundServer

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.server.app import build_app
from nanoserve.server.tenants import Tenancy, tenants_from_options

KEY = "sesame"
OPEN_PATHS = {"/health", "/version", "/metrics"}


def open_paths(app: FastAPI) -> set[str]:
    docs = (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url)
    return OPEN_PATHS | {path for path in docs if path}


def app_operations(app: FastAPI) -> set[tuple[str, str]]:
    """Every (method, path) the app serves: its documented operations and its top-level routes."""
    operations = {(method.upper(), path) for path, item in app.openapi()["paths"].items() for method in item}
    for route in app.routes:
        for method in getattr(route, "methods", None) or ():
            operations.add((method, route.path))
    return {(method, re.sub(r"\{[^}]*\}", "x", path)) for method, path in operations if method != "HEAD"}


@pytest.fixture(scope="module")
def guarded(tiny_model_dir) -> Iterator[tuple[str, FastAPI]]:
    def engine() -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32, max_num_seqs=2))

    app = build_app(engine, model_names=["tiny"], tenancy=Tenancy(tuple(tenants_from_options([KEY]))))
    with BackgroundServer(app) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.base_url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.05)
        yield server.base_url, app


def test_every_route_but_the_open_ones_refuses_a_request_without_the_key(guarded) -> None:
    base_url, app = guarded
    operations = app_operations(app)
    protected = {(method, path) for method, path in operations if path not in open_paths(app)}
    # The walk found the routes this server is known for (an empty walk would pass vacuously).
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
            ("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("POST", "/detokenize")} <= protected
    for method, path in sorted(protected):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
            response = httpx.request(method, f"{base_url}{path}", headers=headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert _auth_error(path, response.json()), (method, path, response.text)
        allowed = httpx.request(method, f"{base_url}{path}", headers={"Authorization": f"Bearer {KEY}"})
        assert allowed.status_code != 401, (method, path)


def _auth_error(path: str, body: dict) -> bool:
    """The refusal in the route's own protocol: Anthropic's error type on its Messages API (and
    its token count), Ollama's error string on its /api routes, OpenAI's error code elsewhere."""
    if path in ("/v1/messages", "/v1/messages/count_tokens"):
        return body["type"] == "error" and body["error"]["type"] == "authentication_error"
    if path.startswith("/api/"):
        return isinstance(body["error"], str) and "API key" in body["error"]
    return body["error"]["code"] == "invalid_api_key"


def test_the_open_routes_answer_without_the_key(guarded) -> None:
    base_url, app = guarded
    for method, path in sorted(app_operations(app)):
        if path in open_paths(app):
            assert httpx.request(method, f"{base_url}{path}").status_code == 200, path


def test_a_good_request_with_the_key_is_served(guarded) -> None:
    base_url, _ = guarded
    body = {"prompt": "Hi", "max_tokens": 1}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
