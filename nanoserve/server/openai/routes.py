"""The endpoints: /v1/completions, /v1/chat/completions, /v1/models (and /v1/models/{id}),
vLLM's /tokenize, /detokenize and /version, /health and /metrics (/v1/embeddings is `embeddings`').

Owns: the API key check, reading a body no larger than the server's limit and validating it
(`read_body`), binding a request to the model its body names (`bind_model`: a 404 naming
`model` for one not served; the request waits while it loads; `parse_body` does both), the
model listing, and the order one generation request goes through (`serve_generation`): the
body checks, the engine's availability, planning (off the event loop), admission, then a
stream or a unary answer, or the answer of a protocol built on chat (Anthropic's Messages,
OpenAI's Responses).
Refuses: the work of each step (planning, generation and streaming own it), and touching the
engine from the event loop: the routes drive the engines through the `EngineBridge`
(bridges/engine_bridge.py) and check requests with its `admission`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from nanoserve.server import planning
from nanoserve.server.bridges.engine_bridge import EngineUnavailableError
from nanoserve.server.bridges.models import ModelNotServedError, ServedModel
from nanoserve.server.errors import APIError, bad_request, from_validation_error
from nanoserve.server.generation import Generation, check_capacity, new_request_id, unary_response
from nanoserve.server.metrics import CONTENT_TYPE, EngineSnapshot
from nanoserve.server.openai import protocol
from nanoserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest, Kind, RequestBody
from nanoserve.server.openai.streaming import stream_response
from nanoserve.server.state import ServerLimits, ServerState, state_of, too_many_requests, unavailable
from nanoserve.server.tenants import Tenant

log = logging.getLogger("nanoserve.server")
ParsedBody = TypeVar("ParsedBody", bound=BaseModel)

# -- plain routes -------------------------------------------------------------------------------

async def require_api_key(request: Request) -> None:
    """Let in a request that carries one of the server's keys, and note whose (`tenant_of`)."""
    tenancy = state_of(request).tenancy
    request.state.tenant = None
    if not tenancy.guarded:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    tenant = tenancy.find(given.strip()) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    request.state.tenant = tenant


def tenant_of(request: Request) -> Tenant | None:
    """The tenant whose key the request carried (None: the server has no keys)."""
    return getattr(request.state, "tenant", None)


async def health(request: Request) -> JSONResponse:
    report = state_of(request).models.health_report()
    return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)


async def metrics(request: Request) -> Response:
    state = state_of(request)
    engine, in_flight = state.async_engine, state.tenancy.in_flight
    if engine is None:  # several models: a series per model, zeros and unhealthy while not loaded
        figures = [(model.name, model.bridge.snapshot, model.bridge.healthy) if model.bridge is not None
                   else (model.name, EngineSnapshot(), False) for model in state.models.models.values()]
        text = state.metrics.render(EngineSnapshot(), healthy=state.models.healthy, in_flight=in_flight,
                                    models=figures)
    else:
        text = state.metrics.render(engine.snapshot, healthy=engine.healthy, in_flight=in_flight,
                                    replicas=engine.replica_figures)
    return Response(text, media_type=CONTENT_TYPE)


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(list_models_body(state_of(request)))


def list_models_body(state: ServerState) -> dict:
    """Every served model's cards (each of its listed names), with its status (loaded, loading,
    or available: loaded on its first request), then the LoRA adapters of a server of one model."""
    data = []
    for model in state.models.models.values():
        data += _model_cards(state, model)
    admission = state.admission
    data += state.adapters.cards(state.created, admission.max_model_len if admission is not None else None)
    return {"object": "list", "data": data}


def _model_cards(state: ServerState, model: ServedModel) -> list[dict]:
    admission = model.bridge.admission if model.bridge is not None else None
    max_model_len = admission.max_model_len if admission is not None else None
    cards = protocol.model_list(list(model.spec.names), max_model_len, state.created)["data"]
    return [{**card, "status": model.status} for card in cards]


async def retrieve_model(request: Request) -> JSONResponse:
    state = state_of(request)
    model_id = request.path_params["model_id"]
    model = state.models.named(model_id)
    if model is not None:
        cards = _model_cards(state, model)
        return JSONResponse(next((c for c in cards if c["id"] == model_id), {**cards[0], "id": model_id}))
    if model_id in state.adapters.served:
        return JSONResponse(next(c for c in list_models_body(state)["data"] if c["id"] == model_id))
    raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                        f"{sorted(state.models.models)}", param="model", code="model_not_found")


async def bind_model(request: Request, name: str | None) -> ServerState:
    """Bind `request` to the model `name` picks and return the state it then reads (as
    `state_of` does from here on). A model not loaded loads now and the request waits (a
    stream's first byte comes once it is ready); the request holds the model until its response
    has ended (`app.ModelLeases` lets it go). 404 naming `model` for a name not served, 400
    for none when the server has several, 503 when the model cannot be loaded."""
    bound = getattr(request.state, "model_state", None)
    if bound is not None:
        return bound
    server: ServerState = request.app.state.server
    try:
        model = await server.models.acquire(name)
    except ModelNotServedError as error:
        if name is None:
            raise bad_request(str(error), "model") from None
        raise APIError(404, str(error), param="model", code="model_not_found") from None
    except EngineUnavailableError as error:
        raise unavailable(str(error), server.limits) from None
    request.state.release_model = functools.partial(server.models.release, model)
    request.state.model_state = server.for_model(model)
    return request.state.model_state


async def version(_: Request) -> JSONResponse:
    from nanoserve import __version__

    return JSONResponse({"version": __version__})


async def tokenize(request: Request) -> JSONResponse:
    body = await parse_body(request, protocol.TokenizeRequest)
    state = state_of(request)
    check_available(state)
    tokens = await asyncio.to_thread(planning.tokenize, state, body)
    max_model_len = state.admission.max_model_len
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len})


async def detokenize(request: Request) -> JSONResponse:
    body = await parse_body(request, protocol.DetokenizeRequest)
    state = state_of(request)
    check_available(state)
    return JSONResponse({"prompt": await asyncio.to_thread(planning.detokenize, state, body)})


def check_tenant_room(state: ServerState, tenant: Tenant | None) -> None:
    """A 429 with Retry-After for a tenant at its limit of generation requests in flight."""
    if not state.tenancy.has_room(tenant):
        state.metrics.count_rejected(tenant.name)
        raise too_many_requests(f"this API key already has {state.tenancy.max_concurrent} requests in "
                                "flight, its limit on this server; retry once one has finished", state.limits)


def check_available(state: ServerState) -> None:
    try:
        state.async_engine.check_available()
    except EngineUnavailableError as error:
        raise unavailable(str(error), state.limits) from None


# -- the two generation routes ------------------------------------------------------------------

async def create_completion(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    return await serve_generation(request, "completion", body)


async def create_chat_completion(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    return await serve_generation(request, "chat", body)


async def parse_body(request: Request, model: type[ParsedBody]) -> ParsedBody:
    """The body, read and validated, and the request bound to the model it names (`bind_model`:
    every route that reads a body serves one model's request)."""
    body = await read_body(request, model)
    await bind_model(request, getattr(body, "model", None))
    return body


async def read_body(request: Request, model: type[ParsedBody]) -> ParsedBody:
    """The body, read and validated, its refused fields refused; the request is not bound to a
    model (for a route that finds the model itself: Ollama's names carry tags, and its /api/show
    reads a model without loading it)."""
    # Parsed by hand, not by FastAPI: the body's size is bounded before it is read whole, and
    # strict validation from JSON makes `"n": "2"` a 400 rather than a guess.
    raw = await _read_body(request, state_of(request).limits)
    try:
        body = model.model_validate_json(raw, strict=True)
    except ValidationError as error:
        raise from_validation_error(error.errors(include_url=False)) from None
    refused = protocol.refused_field(body)
    if refused is not None:
        raise APIError(400, refused.message, param=refused.param, code=refused.code)
    return body


async def _read_body(request: Request, limits: ServerLimits) -> bytes:
    """The body, within the size limit and the time limit; a client that stalls would otherwise
    hold its connection (and a shutdown) for as long as it likes."""
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await _read_chunks(request, limits.max_body_bytes)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       param="body", code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        peer = f"{request.client.host}:{request.client.port}" if request.client else "unknown"
        log.info("client %s hung up while sending its body", peer)
        # Nobody reads the answer; 499 (nginx's "client closed request") keeps the access log honest.
        raise APIError(499, "the client hung up while sending its body", param="body") from None


async def _read_chunks(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over this server's limit of {limit} bytes", param="body",
                    code="request_too_large")


# How a protocol built on chat completions (Messages, Responses) answers a started generation.
Answer = Callable[[Request, Generation, str], Awaitable[Response]]


async def serve_generation(request: Request, kind: Kind, body: RequestBody, answer: Answer | None = None
                           ) -> Response:
    """One generation request, in the one order: body checks, availability, planning,
    admission, then the answer (OpenAI's stream or unary body, or `answer`'s)."""
    arrival_s = time.perf_counter()
    state = state_of(request)
    tenant = tenant_of(request)
    planning.check_body(state, body)
    check_available(state)
    if state.admission.task == "embed":
        raise APIError(400, "this server runs an embedding model (--task embed): it serves /v1/embeddings "
                            "and generates no text", param="model", code="unsupported")
    check_tenant_room(state, tenant)  # before tokenizing: a refusal costs nothing
    plan = await asyncio.to_thread(planning.plan, state, kind, body)
    check_capacity(state, len(plan))
    check_tenant_room(state, tenant)  # again: others of the tenant may have started meanwhile
    lora = state.adapters.lora_for(body.model)  # again: it may have been unloaded while planning
    generation = Generation.start(state, plan, arrival_s, request_id=new_request_id(kind), tenant=tenant,
                                  lora_request=lora)
    model = body.model or state.model_names[0]
    if answer is not None:
        return await answer(request, generation, model)
    if body.stream:
        return stream_response(kind, generation, model, body)
    return await unary_response(request, kind, generation, model)
