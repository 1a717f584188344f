"""The FastAPI app: OpenAI's completions and chat completions over the engine loop thread.

Owns: `build_app`, the routes (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics), the path of one request (read a bounded body, validate, tokenize and check it off
the event loop, hand its sequences to the engine thread, stream or collect what comes back),
the limits that keep one caller from exhausting the server, and aborting the sequences of a
client that hangs up.
Refuses: touching the engine from the event loop (only `AsyncEngine` does, from its thread)
and accepting a field it would ignore.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams
from nanoserve.server import protocol
from nanoserve.server.async_engine import AsyncEngine, EngineUnavailableError
from nanoserve.server.errors import APIError, bad_request, from_validation_error, install_handlers
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest, TokenText

if TYPE_CHECKING:
    from nanoserve.engine import Engine
    from nanoserve.output import RequestOutput, TokenLogprob

log = logging.getLogger("nanoserve.server")
Kind = Literal["completion", "chat"]


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one request may ask for. Each bound keeps one caller from starving the rest."""

    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_tokens: int | None = None  # None: up to the context
    max_top_logprobs: int = MAX_LOGPROBS
    max_waiting: int = 256  # sequences queued beyond the engine's running batch
    retry_after_s: int = 1


@dataclass(slots=True)
class ServerState:
    async_engine: AsyncEngine
    model_names: list[str]
    accepted_names: frozenset[str]
    api_key: str | None
    limits: ServerLimits
    metrics: ServerMetrics
    created: int = field(default_factory=protocol.now_s)
    token_text: TokenText | None = None

    @property
    def engine(self) -> Engine:
        return self.async_engine.engine


def build_app(build_engine: Callable[[], Engine], *, model_names: list[str],
              aliases: tuple[str, ...] = (), api_key: str | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    """The server app. `build_engine` runs on the engine thread at startup; until it returns,
    /health and every /v1 request answer 503."""
    limits = limits or ServerLimits()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine = AsyncEngine(build_engine, asyncio.get_running_loop())
        app.state.server = ServerState(
            async_engine, list(model_names), frozenset((*model_names, *aliases)), api_key, limits,
            ServerMetrics(model_names[0]))
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="nanoserve", version="0.1.0", lifespan=lifespan)
    install_handlers(app)
    app.include_router(_v1_router())
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=PlainTextResponse)
    _document_bodies(app)
    return app


def _v1_router() -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    router.add_api_route("/models", list_models, methods=["GET"])
    router.add_api_route("/completions", create_completion, methods=["POST"],
                         openapi_extra=_body_schema(CompletionRequest))
    router.add_api_route("/chat/completions", create_chat_completion, methods=["POST"],
                         openapi_extra=_body_schema(ChatCompletionRequest))
    return router


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def start_drain(app: FastAPI, drain_s: float) -> None:
    """Begin a shutdown: refuse new requests, give running ones `drain_s` seconds, then end
    them with an error event (streams) or a 503 (unary). Safe from a signal handler or any
    thread; a no-op before startup has finished."""
    state: ServerState | None = getattr(app.state, "server", None)
    if state is not None:
        with contextlib.suppress(RuntimeError):  # the loop has already closed
            state.async_engine.loop.call_soon_threadsafe(state.async_engine.drain, drain_s)


# -- plain routes -------------------------------------------------------------------------------

async def require_api_key(request: Request) -> None:
    key = state_of(request).api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def health(request: Request) -> JSONResponse:
    status = state_of(request).async_engine.status
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


async def metrics(request: Request) -> PlainTextResponse:
    state = state_of(request)
    text = state.metrics.render(state.async_engine.snapshot, healthy=state.async_engine.healthy)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def list_models(request: Request) -> JSONResponse:
    state = state_of(request)
    engine = state.engine
    max_model_len = engine.max_model_len if engine is not None else None
    return JSONResponse(protocol.model_list(state.model_names, max_model_len, state.created))


# -- the two generation routes ------------------------------------------------------------------

async def create_completion(request: Request) -> Response:
    body = await _parse(request, CompletionRequest)
    return await _serve(request, "completion", body)


async def create_chat_completion(request: Request) -> Response:
    body = await _parse(request, ChatCompletionRequest)
    return await _serve(request, "chat", body)


async def _parse(request: Request, model: type[CompletionRequest | ChatCompletionRequest]):
    raw = await _read_body(request, state_of(request).limits.max_body_bytes)
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as error:
        raise from_validation_error(error.errors(include_url=False)) from None


async def _read_body(request: Request, limit: int) -> bytes:
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


async def _serve(request: Request, kind: Kind, body: CompletionRequest | ChatCompletionRequest) -> Response:
    arrival_s = time.perf_counter()
    state = state_of(request)
    _check_model(state, body.model)
    _check_supported(body, state.limits)
    try:
        state.async_engine.check_available()
    except EngineUnavailableError as error:
        raise _unavailable(str(error), state.limits) from None
    plan = await asyncio.to_thread(_plan, state, kind, body)
    _check_capacity(state, len(plan))
    generation = Generation.start(state, plan, arrival_s, request_id=_request_id(kind))
    model = body.model or state.model_names[0]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream_events(state, kind, generation, model, include_usage)
        return EventStreamResponse(events, on_close=generation.close)
    try:
        await _until_done_or_disconnect(request, generation)
    except ClientDisconnectedError:
        return Response(status_code=499)  # nobody is listening; the sequences are aborted below
    finally:
        generation.close()
    return JSONResponse(_unary_body(state, kind, generation, model))


def _request_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.accepted_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{state.model_names[0]!r}", param="model", code="model_not_found")


def _check_supported(body: CompletionRequest | ChatCompletionRequest, limits: ServerLimits) -> None:
    refused = body.unsupported()
    if refused is not None:
        raise bad_request(refused[1], refused[0], code="unsupported")
    if body.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n} on this server; got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    top, name = _top_logprobs(body)
    if top is not None and top > limits.max_top_logprobs:
        raise bad_request(f"{name} must be at most {limits.max_top_logprobs}; got {top}", name)
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")


def _top_logprobs(body: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, str]:
    if isinstance(body, CompletionRequest):
        return body.logprobs, "logprobs"
    if not body.logprobs:
        return None, "top_logprobs"
    return body.top_logprobs or 0, "top_logprobs"


def _unavailable(message: str, limits: ServerLimits) -> APIError:
    return APIError(503, message, code="service_unavailable",
                    headers={"Retry-After": str(limits.retry_after_s)})


def _check_capacity(state: ServerState, num_sequences: int) -> None:
    engine = state.async_engine
    capacity = state.engine.config.max_num_seqs + state.limits.max_waiting
    if num_sequences > capacity:
        raise bad_request(f"this request asks for {num_sequences} sequences (prompts x n); this server "
                          f"holds at most {capacity} at a time", "n")
    if engine.num_in_flight + num_sequences > capacity:
        raise _unavailable(f"the server is at capacity ({capacity} sequences in flight); retry shortly",
                           state.limits)


# -- planning: from a validated body to the engine's sequences, off the event loop --------------

@dataclass(frozen=True, slots=True)
class PlannedSequence:
    index: int  # the choice index: prompt_index * n + j
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


def _plan(state: ServerState, kind: Kind, body: CompletionRequest | ChatCompletionRequest
          ) -> list[PlannedSequence]:
    """Tokenize, fill in max_tokens and seeds, and run every engine check: 400s happen here."""
    engine = state.engine
    prompts = _prompt_ids(engine, kind, body, state.limits)
    base = _base_params(body)
    sequences = []
    for prompt_index, prompt_ids in enumerate(prompts):
        max_tokens = _max_tokens(engine, body, len(prompt_ids), state.limits)
        for j in range(body.n):
            params = _params_for(body, base, max_tokens, j)
            _engine_check(engine, prompt_ids, params, body)
            sequences.append(PlannedSequence(prompt_index * body.n + j, prompt_index, prompt_ids, params))
    return sequences


def _prompt_ids(engine: Engine, kind: Kind, body: CompletionRequest | ChatCompletionRequest,
                limits: ServerLimits) -> list[list[int]]:
    if kind == "chat":
        try:
            text = engine.tokenizer.apply_chat_template(body.chat_messages())
        except protocol.UnsupportedContentError as error:
            raise bad_request(str(error), error.param) from None
        except InvalidRequestError as error:
            raise bad_request(error.message, error.param or "messages") from None
        return [_encode(engine, engine.tokenizer.encode(text, add_bos=False), "messages")]
    prompt = body.prompt
    single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
    prompts = [prompt] if single else list(prompt)
    if not prompts:
        raise bad_request("prompt is empty: give a string, a list of token ids or a list of prompts",
                          "prompt")
    if len(prompts) > limits.max_prompts:
        raise bad_request(f"at most {limits.max_prompts} prompts per request; got {len(prompts)}", "prompt")
    return [_encode(engine, p, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
            for i, p in enumerate(prompts)]


def _encode(engine: Engine, prompt: str | list[int], param: str) -> list[int]:
    try:
        return engine.encode_prompt(prompt)
    except InvalidRequestError as error:
        raise bad_request(error.message, param) from None


def _base_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    fields: dict[str, Any] = {
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos, "seed": body.seed,
        "stop": body.stop, "stop_token_ids": body.stop_token_ids,
        "logprobs": _top_logprobs(body)[0],
        "logit_bias": _logit_bias(body.logit_bias),
    }
    given = {name: value for name, value in fields.items() if value is not None}
    # max_tokens is set per prompt (`_params_for`); this placeholder only has to admit min_tokens.
    given["max_tokens"] = max(1, body.min_tokens or 0)
    return _sampling_params(body, **given)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        token = key.strip()
        if not token.isascii() or not token.isdigit() or len(token) > 10:
            raise bad_request(f"logit_bias keys must be token ids (decimal strings); got {key!r}",
                              "logit_bias")
        out[int(token)] = value
    return out


def _sampling_params(body: CompletionRequest | ChatCompletionRequest, **fields: Any) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as error:
        raise bad_request(error.message, _client_param(body, error.param)) from None


def _client_param(body: CompletionRequest | ChatCompletionRequest, param: str | None) -> str | None:
    """The field the client actually sent for an engine-side name."""
    if isinstance(body, ChatCompletionRequest):
        if param == "logprobs":
            return "top_logprobs"
        if param == "max_tokens" and body.max_completion_tokens is not None:
            return "max_completion_tokens"
    return param


def _max_tokens(engine: Engine, body: CompletionRequest | ChatCompletionRequest, num_prompt: int,
                limits: ServerLimits) -> int:
    asked = body.max_tokens
    name = "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        asked, name = body.max_completion_tokens, "max_completion_tokens"
    if asked is not None:
        if limits.max_tokens is not None and asked > limits.max_tokens:
            raise bad_request(f"{name} must be at most {limits.max_tokens} on this server; got {asked}", name)
        return asked
    room = engine.scheduler.max_request_tokens - num_prompt
    if room < 1:
        raise bad_request(f"the prompt has {num_prompt} tokens, which leaves no room to generate in this "
                          f"server's context of {engine.scheduler.max_request_tokens} tokens",
                          "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
    return room if limits.max_tokens is None else min(room, limits.max_tokens)


def _params_for(body: CompletionRequest | ChatCompletionRequest, base: SamplingParams, max_tokens: int,
                j: int) -> SamplingParams:
    changes: dict[str, Any] = {"max_tokens": max_tokens}
    if base.seed is not None and j:
        if base.seed + j >= MAX_SEED:
            raise bad_request(f"seed + n - 1 must stay below 2**63 (choice i uses seed + i); got seed "
                              f"{base.seed} with n={body.n}", "seed")
        changes["seed"] = base.seed + j
    try:
        return dataclasses.replace(base, **changes)
    except InvalidRequestError as error:
        raise bad_request(error.message, _client_param(body, error.param)) from None


def _engine_check(engine: Engine, prompt_ids: list[int], params: SamplingParams,
                  body: CompletionRequest | ChatCompletionRequest) -> None:
    try:
        engine.check_request(prompt_ids, params)
    except InvalidRequestError as error:
        param = error.param
        if param == "prompt" and isinstance(body, ChatCompletionRequest):
            param = "messages"
        raise bad_request(error.message, _client_param(body, param)) from None


# -- one request's sequences in flight ----------------------------------------------------------

@dataclass(slots=True)
class Choice:
    """One sequence's output so far and its timings."""

    index: int
    prompt_index: int
    request_id: str
    num_prompt_tokens: int
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stop_token_ids: tuple[int, ...] = ()
    last_s: float = 0.0
    text_offset: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Generation:
    """The sequences of one HTTP request, read from one queue the engine thread feeds."""

    state: ServerState
    request_id: str
    arrival_s: float
    queue: asyncio.Queue
    choices: dict[str, Choice]
    error: BaseException | None = None

    @classmethod
    def start(cls, state: ServerState, plan: list[PlannedSequence], arrival_s: float, *,
              request_id: str) -> Generation:
        queue: asyncio.Queue = asyncio.Queue()
        ids = [f"{request_id}-{seq.index}" for seq in plan]
        choices = {seq_id: Choice(seq.index, seq.prompt_index, seq_id, len(seq.prompt_ids),
                                  stop_token_ids=seq.params.stop_token_ids)
                   for seq_id, seq in zip(ids, plan, strict=True)}
        generation = cls(state, request_id, arrival_s, queue, choices)
        for seq_id, seq in zip(ids, plan, strict=True):
            try:
                state.async_engine.add(seq_id, seq.prompt_ids, seq.params, queue)
            except EngineUnavailableError as error:
                generation.close()
                raise _unavailable(str(error), state.limits) from None
        return generation

    @property
    def done(self) -> bool:
        return self.error is not None or all(choice.finished for choice in self.choices.values())

    async def next_outputs(self) -> list[tuple[Choice, RequestOutput]]:
        """Wait for at least one output, then take all that are ready."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        outputs = []
        for item in items:
            if isinstance(item, BaseException):
                self.error = item
                continue
            choice = self.choices[item.request_id]
            self._record(choice, item)
            outputs.append((choice, item))
        return outputs

    def _record(self, choice: Choice, output: RequestOutput) -> None:
        now = time.perf_counter()
        metrics = self.state.metrics
        if choice.num_tokens == 0:
            metrics.ttft.observe(now - self.arrival_s)
        else:
            metrics.itl.observe(now - choice.last_s)
        choice.last_s = now
        choice.num_tokens = output.num_output_tokens
        if output.finished:
            if output.finish_reason == "abort":
                self.error = EngineUnavailableError("the request was aborted by the server")
                return
            choice.finish_reason, choice.stop_reason = output.finish_reason, output.stop_reason
            if isinstance(output.stop_reason, int) and output.stop_reason not in choice.stop_token_ids:
                choice.stop_reason = None  # EOS, as vLLM reports it; a stop_token_ids hit names its id
            metrics.e2e.observe(now - self.arrival_s)
            metrics.finished[output.finish_reason] += 1

    def close(self) -> None:
        """Abort every sequence still running (the client left, or the request failed)."""
        for choice in self.choices.values():
            if not choice.finished:
                self.state.async_engine.abort(choice.request_id)

    def usage(self) -> dict[str, int]:
        prompt_tokens = {c.prompt_index: c.num_prompt_tokens for c in self.choices.values()}
        completion = sum(c.num_tokens for c in self.choices.values())
        return protocol.usage(sum(prompt_tokens.values()), completion)


async def _until_done_or_disconnect(request: Request, generation: Generation) -> None:
    """Collect every output; if the client hangs up first, stop (the caller aborts)."""
    async def collect() -> None:
        while not generation.done:
            for choice, output in await generation.next_outputs():
                choice.texts.append(output.text)
                if output.logprobs is not None:
                    choice.logprobs = (choice.logprobs or []) + output.logprobs

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collecting, watching):
            task.cancel()
    if collecting.done() and not collecting.cancelled():
        collecting.result()
    if not generation.done:
        raise ClientDisconnectedError
    if generation.error is not None:
        raise _unavailable(str(generation.error), generation.state.limits)


class ClientDisconnectedError(Exception):
    """The client hung up before its unary response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _unary_body(state: ServerState, kind: Kind, generation: Generation, model: str) -> dict[str, Any]:
    body = protocol.envelope(kind, generation.request_id, model, protocol.now_s(), chunk=False)
    names = _token_text(state)
    make = protocol.chat_choice if kind == "chat" else protocol.completion_choice
    choices = []
    for choice in sorted(generation.choices.values(), key=lambda c: c.index):
        logprobs = _logprobs(kind, choice.logprobs, names, 0) if choice.logprobs is not None else None
        choices.append(make(choice.index, "".join(choice.texts), logprobs, choice.finish_reason,
                            choice.stop_reason))
    body["choices"] = choices
    body["usage"] = generation.usage()
    return body


def _logprobs(kind: Kind, entries: list[TokenLogprob], names: TokenText, text_offset: int) -> dict:
    if kind == "chat":
        return protocol.chat_logprobs(entries, names)
    return protocol.completion_logprobs(entries, names, text_offset)


def _token_text(state: ServerState) -> TokenText:
    if state.token_text is None:
        state.token_text = TokenText(state.engine.tokenizer)
    return state.token_text


# -- streaming ------------------------------------------------------------------------------------

class EventStreamResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (done, hang-up, cancel)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], *, on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def _stream_events(state: ServerState, kind: Kind, generation: Generation, model: str,
                         include_usage: bool) -> AsyncIterator[str]:
    created = protocol.now_s()
    head = protocol.envelope(kind, generation.request_id, model, created, chunk=True)
    if include_usage:
        head["usage"] = None
    try:
        async for events in _chunks(state, kind, generation, head):
            yield events
        if generation.error is not None:
            yield sse(_unavailable(str(generation.error), state.limits).body())
        elif include_usage:
            yield sse({**head, "choices": [], "usage": generation.usage()})
    except Exception as error:  # a bug: the client still gets a well-formed end of stream
        log.exception("error while streaming %s", generation.request_id)
        yield sse(APIError(500, f"internal error: {type(error).__name__}").body())
    yield SSE_DONE


async def _chunks(state: ServerState, kind: Kind, generation: Generation,
                  head: dict[str, Any]) -> AsyncIterator[str]:
    names = _token_text(state)
    if kind == "chat":
        yield "".join(sse({**head, "choices": [protocol.chat_delta_choice(
            c.index, {"role": "assistant", "content": ""}, None, None, None)]})
            for c in sorted(generation.choices.values(), key=lambda c: c.index))
    while not generation.done:
        events = [sse({**head, "choices": [_delta_choice(kind, choice, output, names)]})
                  for choice, output in await generation.next_outputs()
                  if output.text or output.logprobs or choice.finished]
        if events:
            yield "".join(events)


def _delta_choice(kind: Kind, choice: Choice, output: RequestOutput, names: TokenText) -> dict[str, Any]:
    logprobs = None
    if output.logprobs is not None:
        logprobs = _logprobs(kind, output.logprobs, names, choice.text_offset)
        if kind == "completion":
            choice.text_offset += sum(len(token) for token in logprobs["tokens"])
    if kind == "chat":
        delta = {"content": output.text} if output.text else {}
        return protocol.chat_delta_choice(choice.index, delta, logprobs, choice.finish_reason,
                                          choice.stop_reason)
    return protocol.completion_choice(choice.index, output.text, logprobs, choice.finish_reason,
                                      choice.stop_reason)


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
            for model in (CompletionRequest, ChatCompletionRequest):
                defs = model.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {})
                schemas.update(defs)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


# -- running the app in this process ------------------------------------------------------------

# After the drain deadline, time for the error events to reach clients before uvicorn cuts.
DRAIN_GRACE_S = 3.0


class BackgroundServer:
    """The app on a real uvicorn socket in a daemon thread (tests, notebooks, embedding).

    `with BackgroundServer(app) as server:` starts it on a free loopback port and waits until
    it accepts connections; `server.base_url` is where. Leaving stops it, draining for at
    most `drain_s`.
    """

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", drain_s: float = 5.0) -> None:
        import uvicorn

        self.app = app
        self.host = host
        self.drain_s = drain_s
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning",
                                                    timeout_graceful_shutdown=drain_s + DRAIN_GRACE_S))
        self.thread = threading.Thread(target=self.server.run, name="nanoserve-uvicorn", daemon=True)
        self.base_url = ""

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{self.host}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        start_drain(self.app, self.drain_s)
        self.server.should_exit = True
        self.thread.join(timeout=60)
