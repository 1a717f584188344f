"""The FastAPI app: `build_app` wires the routes, the engine thread and the error handlers.

Owns: building the app (the models it serves, `ModelRegistry`: one model's engine thread starts
with the app, several models' each on its first request, and all stop with it; how a model's
bridge is built; the state every request reads; the routes and their paths; the API key on /v1,
/tokenize and /detokenize; OpenAI-shaped errors; `ModelLeases`, which lets a request's model go
once its response has ended), the OpenAPI description of the bodies the routes parse
by hand, `start_drain`, the bounded shutdown that `nanoserve serve` starts on SIGTERM, and
`stop_now`, which ends that shutdown at once on a second signal.
Refuses: the path of a request (`routes`, `planning`, `generation`, `streaming` own it), and
running uvicorn (`nanoserve serve` does; tests have their own harness).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import Response

from nanoserve.server.adapters import AdapterRegistry, LoRAModule
from nanoserve.server.anthropic import messages
from nanoserve.server.bridges.async_engine import PREFILL_LOG_S, AsyncEngine
from nanoserve.server.bridges.engine_bridge import EngineBridge, EngineUnavailableError
from nanoserve.server.bridges.models import ModelPolicy, ModelRegistry, ModelSpec
from nanoserve.server.bridges.replicas import ReplicaPlan, ReplicaPool
from nanoserve.server.errors import install_handlers
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.ollama import api as ollama_api
from nanoserve.server.openai import adapter_routes, embeddings, responses, routes
from nanoserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nanoserve.server.parsers.reasoning import ReasoningConfig
from nanoserve.server.state import ServerLimits, ServerState
from nanoserve.server.tenants import Tenancy

if TYPE_CHECKING:
    from nanoserve.engine.core import Engine

__all__ = ["DRAIN_GRACE_S", "STOP_NOW_GRACE_S", "ModelPolicy", "ModelSpec", "ServerLimits", "Tenancy",
           "build_app", "reload_keys", "start_drain", "stop_now"]

# After the drain deadline, time for the error events to reach clients before uvicorn cuts.
DRAIN_GRACE_S = 3.0
# After a second signal, time for the error events (already queued) to be written.
STOP_NOW_GRACE_S = 0.5


def build_app(build_engine: Callable[[], Engine] | None = None, *, model_names: Sequence[str] = (),
              aliases: tuple[str, ...] = (), models: tuple[ModelSpec, ...] = (),
              model_policy: ModelPolicy | None = None, tenancy: Tenancy | None = None,
              limits: ServerLimits | None = None, seed: int | None = None,
              sse_keep_alive_s: float = 15.0, prefill_log_s: float = PREFILL_LOG_S,
              on_engine_death: Callable[[BaseException], None] | None = None,
              reasoning: ReasoningConfig | None = None, replicas: ReplicaPlan | None = None,
              lora_modules: tuple[LoRAModule, ...] = (), lora_runtime_updates: bool = False,
              tool_call_parser: str = "auto") -> FastAPI:
    """The server app, of one model or of several.

    One model: `build_engine`, served as `model_names` (the first is its name, all are listed)
    and `aliases`; it runs on the engine thread at startup, and until it returns /health and
    every /v1 request answer 503. Several: `models`, each built on its first request (which
    waits) and unloaded as `model_policy` says (bridges/models.py); a request picks one by its
    `model`. `tenancy`: the API keys (each a tenant) and what the server keeps apart between
    tenants, across every model; None: no key. `seed`: unseeded requests draw their seeds, in
    arrival order, from a generator seeded with it (None: the engine picks each at random).
    `sse_keep_alive_s`: a stream that long without a token gets a keep-alive comment.
    `prefill_log_s`: a prefill running that long gets a progress line in the log, then again.
    `on_engine_death`: called on the event loop if the one model's engine thread dies (`nanoserve serve`
    stops the server and exits non-zero, rather than answering 503 for ever).
    `reasoning`: the reasoning parser and default budget; a named parser the model's
    vocabulary cannot serve stops the engine at startup.
    `replicas`: serve from that many data-parallel engine processes (`replicas.py`) instead of
    `build_engine` on a thread of this one. `lora_modules`: LoRA adapters loaded at startup
    (an adapter the engine refuses stops it), which requests pick by `model`;
    `lora_runtime_updates`: serve vLLM's load/unload routes (else they answer 404). Neither
    beside `replicas` or several models yet, nor `replicas` beside several models (a ValueError).
    `tool_call_parser`: the format a chat's tool calls are read in and constrained to (vLLM's
    names; auto: from each model's chat template)."""
    limits = limits or ServerLimits()
    tenancy = tenancy or Tenancy()
    reasoning = reasoning or ReasoningConfig()
    registry = _registry(build_engine, model_names, aliases, models, model_policy)
    if (replicas is not None or not registry.pinned) and (lora_modules or lora_runtime_updates):
        raise ValueError("LoRA adapters are served beside neither data-parallel replicas nor several "
                         "models yet")
    if replicas is not None and not registry.pinned:
        raise ValueError("data-parallel replicas are not served beside several models yet")
    listed = [name for spec in registry.specs for name in spec.names]
    accepted = frozenset(name for spec in registry.specs for name in spec.accepted)
    adapters = AdapterRegistry(accepted, listed[0], tuple(lora_modules), lora_runtime_updates)

    def build_checked_engine(spec: ModelSpec) -> Engine:
        engine = spec.build_engine()
        reasoning.tags(engine.tokenizer)
        adapters.load_at_start(engine)
        return engine

    def make_bridge(spec: ModelSpec, on_ready: Callable[[], None],
                    on_death: Callable[[BaseException], None]) -> EngineBridge:
        loop = asyncio.get_running_loop()
        if replicas is not None:
            return ReplicaPool(replicas, loop, on_death=on_death,
                               check_engine=lambda admission: reasoning.tags(admission.tokenizer))
        return AsyncEngine(lambda: build_checked_engine(spec), loop, prefill_log_s=prefill_log_s,
                           on_ready=on_ready, on_death=on_death)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.start(asyncio.get_running_loop(), make_bridge, on_pinned_death=on_engine_death)
        pinned = registry.only if registry.pinned else None
        app.state.server = ServerState(
            pinned.bridge if pinned is not None else None, listed, accepted, tenancy, limits,
            ServerMetrics(listed[0], tuple(t.name for t in tenancy.tenants)),
            sse_keep_alive_s=sse_keep_alive_s,
            default_seeds=None if seed is None else random.Random(seed), reasoning=reasoning,
            adapters=adapters, models=registry, tool_call_parser=tool_call_parser)
        try:
            yield
        finally:
            await registry.stop()

    # No 307 to the other spelling of a path: a client that does not follow it loses its POST
    # body. `TrailingSlashes` serves both spellings instead.
    app = FastAPI(title="nanoserve", version="0.1.0", lifespan=lifespan, redirect_slashes=False)
    app.add_middleware(TrailingSlashes)
    app.add_middleware(ModelLeases)
    install_handlers(app)
    app.include_router(_v1_router())
    # Behind its own key check: Anthropic's clients send x-api-key, and errors in Anthropic's shape.
    app.add_api_route("/v1/messages", messages.create_message, methods=["POST"],
                      openapi_extra=_body_schema(messages.MessagesRequest))
    app.add_api_route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"],
                      openapi_extra=_body_schema(messages.CountTokensRequest))
    _add_ollama_routes(app)
    app.include_router(_tokenizer_router())
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"], response_class=Response)
    _document_bodies(app)
    return app


def _registry(build_engine: Callable[[], Engine] | None, model_names: Sequence[str], aliases: tuple[str, ...],
              models: tuple[ModelSpec, ...], policy: ModelPolicy | None) -> ModelRegistry:
    """One model (pinned: loaded at start, never unloaded) or several (loaded on demand)."""
    if (build_engine is None) == (not models):
        raise ValueError("give build_app either build_engine (one model) or models (several)")
    if build_engine is not None:
        if not model_names:
            raise ValueError("one model needs its model_names")
        return ModelRegistry((ModelSpec(tuple(model_names), build_engine, tuple(aliases)),), pinned=True)
    return ModelRegistry(tuple(models), policy or ModelPolicy())


def _v1_router() -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(routes.require_api_key)])
    router.add_api_route("/models", routes.list_models, methods=["GET"])
    router.add_api_route("/models/{model_id:path}", routes.retrieve_model, methods=["GET"])
    router.add_api_route("/embeddings", embeddings.create_embeddings, methods=["POST"],
                         openapi_extra=_body_schema(embeddings.EmbeddingRequest))
    router.add_api_route("/completions", routes.create_completion, methods=["POST"],
                         openapi_extra=_body_schema(CompletionRequest))
    router.add_api_route("/chat/completions", routes.create_chat_completion, methods=["POST"],
                         openapi_extra=_body_schema(ChatCompletionRequest))
    router.add_api_route("/responses", responses.create_response, methods=["POST"],
                         openapi_extra=_body_schema(responses.ResponsesRequest))
    router.add_api_route("/load_lora_adapter", adapter_routes.load_lora_adapter, methods=["POST"],
                         openapi_extra=_body_schema(adapter_routes.LoadLoRAAdapterRequest))
    router.add_api_route("/unload_lora_adapter", adapter_routes.unload_lora_adapter, methods=["POST"],
                         openapi_extra=_body_schema(adapter_routes.UnloadLoRAAdapterRequest))
    return router


def _add_ollama_routes(app: FastAPI) -> None:
    """Ollama's API at /api, each route checking the key itself: errors in Ollama's shape."""
    for path, route, body in (("/api/chat", ollama_api.chat, ollama_api.OllamaChatRequest),
                              ("/api/generate", ollama_api.generate, ollama_api.OllamaGenerateRequest),
                              ("/api/embed", ollama_api.embed, ollama_api.OllamaEmbedRequest),
                              ("/api/show", ollama_api.show, ollama_api.OllamaShowRequest)):
        app.add_api_route(path, route, methods=["POST"], openapi_extra=_body_schema(body))
    for path, route in (("/api/tags", ollama_api.tags), ("/api/ps", ollama_api.ps),
                        ("/api/version", ollama_api.version)):
        app.add_api_route(path, route, methods=["GET"])


def _tokenizer_router() -> APIRouter:
    """vLLM's /tokenize and /detokenize, at the root as vLLM has them, behind the same API key."""
    router = APIRouter(dependencies=[Depends(routes.require_api_key)])
    router.add_api_route("/tokenize", routes.tokenize, methods=["POST"],
                         openapi_extra=_body_schema(TokenizeRequest))
    router.add_api_route("/detokenize", routes.detokenize, methods=["POST"],
                         openapi_extra=_body_schema(DetokenizeRequest))
    return router


class ModelLeases:
    """Let go of the model a request was bound to (`routes.bind_model`) once its response has
    ended, a stream's last event included: until then the model is never unloaded."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # the request's `request.state`, shared by every layer
        try:
            await self.app(scope, receive, send)
        finally:
            release = state.pop("release_model", None)
            if release is not None:
                release()


class TrailingSlashes:
    """Serve `/v1/completions/` as `/v1/completions` (and so for every path)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
        await self.app(scope, receive, send)


def start_drain(app: FastAPI, drain_s: float) -> None:
    """Begin a shutdown: refuse new requests, give running ones `drain_s` seconds, then end
    them with an error event (streams) or a 503 (unary). Safe from a signal handler or any
    thread; a no-op before startup has finished."""
    state: ServerState | None = getattr(app.state, "server", None)
    if state is not None:
        with contextlib.suppress(RuntimeError):  # the loop has already closed
            state.models.loop.call_soon_threadsafe(state.models.drain, drain_s)


def reload_keys(app: FastAPI) -> None:
    """Re-read the API keys file (SIGHUP), on the event loop; safe from a signal handler. A file
    that no longer reads is logged and the keys in use stay."""
    state: ServerState | None = getattr(app.state, "server", None)

    def reload() -> None:
        if state.tenancy.reload():
            state.metrics.add_tenants(tuple(t.name for t in state.tenancy.tenants))

    if state is not None:
        with contextlib.suppress(RuntimeError):  # the loop has already closed
            state.models.loop.call_soon_threadsafe(reload)


def stop_now(app: FastAPI, then: Callable[[], None]) -> bool:
    """End a shutdown at once (a second SIGTERM or SIGINT): every open stream gets its error
    event and every unary request its 503 now, the engine is left in the middle of its step,
    and `then` runs on the event loop `STOP_NOW_GRACE_S` later (uvicorn's force exit: by then
    the error events are written). Safe from a signal handler. False before startup has
    finished: there is nothing to end, and `then` is the caller's to run."""
    state: ServerState | None = getattr(app.state, "server", None)
    if state is None:
        return False
    loop = state.models.loop

    def stop() -> None:
        state.models.stop_now(EngineUnavailableError(
            "the server was stopped by a second shutdown signal before the request finished"))
        loop.call_later(STOP_NOW_GRACE_S, then)

    try:
        loop.call_soon_threadsafe(stop)
    except RuntimeError:  # the loop has already closed
        return False
    return True


# -- OpenAPI: document the bodies the routes parse by hand ----------------------------------------

def _body_schema(model: type) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _document_bodies(app: FastAPI) -> None:
    """Add the request models' nested definitions to the OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                          messages.MessagesRequest, responses.ResponsesRequest, embeddings.EmbeddingRequest,
                          ollama_api.OllamaChatRequest, ollama_api.OllamaGenerateRequest):
                defs = model.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {})
                schemas.update(defs)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
