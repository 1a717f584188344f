"""Ollama's API beside OpenAI's: /api/chat, /api/generate and /api/embed, and the routes of
`ollama_models` (/api/tags, /api/show, /api/ps, /api/version).

Owns: the request models (Ollama's api/types.go: ChatRequest, GenerateRequest, EmbedRequest,
ShowRequest, and `options` with Ollama's names), `OLLAMA_REFUSED`, the fields refused by name;
each body as a chat or completion request (`chat_request`, `generate_request`), so planning,
generation, tools and reasoning are the OpenAI endpoints' own; Ollama's answers: streamed
NDJSON by default (one JSON object a line, the last with done: true, done_reason and the
timings in nanoseconds), one JSON object with stream: false, and errors as
`{"error": "<field>: <why>"}` with the status the OpenAI endpoints give.

How Ollama's options map: num_predict -> max_tokens (-1, -2 or absent: until the context is
full), repeat_penalty -> repetition_penalty (over the whole prompt and output: repeat_last_n
may only be -1, the whole context, or 0, no penalty), num_ctx -> the request's window (refused
above the model's context), temperature, top_k, top_p, min_p, typical_p, presence_penalty,
frequency_penalty, seed, stop and mirostat, mirostat_tau, mirostat_eta as they are. With no
options, Ollama's defaults: temperature 0.8, top_k 40, top_p 0.9 (top_k and top_p left off
under mirostat, which replaces them). format "json" or a JSON schema: structured output.
think: true needs a reasoning parser (its thinking comes back as `thinking`); false asks the
template not to think.

How a request reaches its model: the name it sends (with or without ":latest", `models.find`;
another is Ollama's 404 `model 'x' not found`) is bound through the server's registry as the
OpenAI routes bind theirs (`routes.bind_model`): a model not loaded loads now and the request
waits (a stream's first line comes once it is ready), its load_duration the time it waited
when it started that load. keep_alive (a Go duration "5m", "1h30m", or seconds; negative: keep
loaded; 0: unload once idle; absent: the server's --idle-unload-s) is the model's keep-alive
for the rest of its load (`ModelRegistry.keep_alive`). Nothing to generate (no prompt, no messages) is
Ollama's "load the model" (done_reason "load"), and with keep_alive 0 its "unload the model"
(done_reason "unload"; nothing loads for it). A one-model server's model is loaded for good:
keep_alive does not unload it, and the unload idiom is a 400 naming keep_alive.
Refuses (named 400s): images (the served models read text), suffix, template, context,
truncate and shift (Ollama's context cutting), load options (num_gpu, num_thread, ...).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError

from nanoserve.server import planning
from nanoserve.server.bridges.models import ServedModel
from nanoserve.server.errors import APIError, bad_request, from_validation_error
from nanoserve.server.generation import Generation, unary_response
from nanoserve.server.ollama import models as ollama_models
from nanoserve.server.ollama.models import timestamp
from nanoserve.server.openai import embeddings, routes
from nanoserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Int64,
    Kind,
    OpenAIModel,
    Refusal,
    RequestBody,
    absent_or,
    empty_or_absent,
)
from nanoserve.server.openai.streaming import EventStreamResponse, chunk_batches
from nanoserve.server.state import ServerState, state_of

OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's, with no options
_LOAD_OPTION = "is a load option: the model is loaded once, by nanoserve serve"
_NO_IMAGES = "images are not supported: the served model reads text"
OLLAMA_REFUSED: dict[str, Refusal] = {
    "suffix": Refusal("suffix (fill in the middle) is not supported", absent_or("")),
    "template": Refusal("a request's own template is not supported: the model's chat template is used",
                        absent_or("")),
    "context": Refusal("context (the token memory of an earlier /api/generate) is not supported: send "
                       "the conversation to /api/chat", empty_or_absent),
    "images": Refusal(_NO_IMAGES, empty_or_absent),
    "messages[].images": Refusal(_NO_IMAGES, empty_or_absent),
    "truncate": Refusal("truncating the input to the context is not supported: a prompt that does not "
                        "fit is refused", absent_or(False)),
    "shift": Refusal("shifting the context is not supported: generation ends when the context is full",
                     absent_or(False)),
    "_debug_render_only": Refusal("_debug_render_only is not supported", absent_or(False)),
    "width": Refusal("image generation is not supported"),
    "height": Refusal("image generation is not supported"),
    "steps": Refusal("image generation is not supported"),
    **{f"options.{name}": Refusal(f"{name} {_LOAD_OPTION}") for name in (
        "num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_thread", "numa", "low_vram",
        "f16_kv", "logits_all", "vocab_only", "embedding_only", "draft_num_predict")},
    "verbose": Refusal("verbose model information (the tokenizer's arrays, tensors) is not served",
                       absent_or(False)),
    "options.num_keep": Refusal("num_keep is not supported: the context is never shifted"),
    "options.tfs_z": Refusal("tail-free sampling (tfs_z) is not supported", absent_or(1, 1.0)),
    "options.penalize_newline": Refusal("penalize_newline false is not supported: the repeat penalty "
                                        "applies to every token", absent_or(True)),
}
SAME_NAMED_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "presence_penalty",
                      "frequency_penalty", "seed", "stop", "mirostat", "mirostat_tau", "mirostat_eta")
# The translated body's fields, by the names the Ollama client sent them under.
OLLAMA_PARAMS = {
    "max_tokens": "options.num_predict", "repetition_penalty": "options.repeat_penalty",
    **{name: f"options.{name}" for name in SAME_NAMED_OPTIONS},
    "response_format": "format", "chat_template_kwargs": "think", "thinking_token_budget": "think",
}
# keep_alive: Go's time.ParseDuration spelling ("5m", "1h30m", "-1s"), or a number of seconds.
_NUMBER = r"(?:\d+\.?\d*|\.\d+)"
_DURATION = re.compile(rf"([-+]?)((?:{_NUMBER}(?:ns|us|µs|μs|ms|s|m|h))+)")
_DURATION_PART = re.compile(rf"({_NUMBER})(ns|us|µs|μs|ms|s|m|h)")
_SECONDS = re.compile(rf"[-+]?{_NUMBER}")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
NS_PER_S = 1_000_000_000
ParsedBody = TypeVar("ParsedBody", bound=BaseModel)


class OllamaOptions(OpenAIModel):
    """The runtime options, by Ollama's names (api/types.go's Options)."""

    num_ctx: int | None = Field(default=None, ge=1)
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: list[str] | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None


class ToolCallFunction(OpenAIModel):
    index: int | None = None
    name: str
    arguments: dict[str, Any]


class ToolCall(OpenAIModel):
    id: str | None = None
    function: ToolCallFunction


class OllamaMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class GenerationFields(OpenAIModel):
    refused_fields: ClassVar[dict[str, Refusal]] = OLLAMA_REFUSED

    model: str
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    keep_alive: str | float | None = None
    options: OllamaOptions | None = None
    think: bool | Literal["high", "medium", "low"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)


class OllamaChatRequest(GenerationFields):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(GenerationFields):
    prompt: str = ""
    system: str | None = None
    raw: bool = False


class OllamaEmbedRequest(OpenAIModel):
    refused_fields: ClassVar[dict[str, Refusal]] = OLLAMA_REFUSED

    model: str
    input: str | list[str]
    dimensions: int | None = Field(default=None, ge=1)
    keep_alive: str | float | None = None
    options: OllamaOptions | None = None


class OllamaShowRequest(OpenAIModel):
    refused_fields: ClassVar[dict[str, Refusal]] = OLLAMA_REFUSED

    model: str | None = None
    name: str | None = None  # Ollama's older spelling of model


# -- errors ---------------------------------------------------------------------------------------

def error_response(error: APIError, renamed: dict[str, str] | None = None) -> JSONResponse:
    """Ollama's error shape; `renamed`: the translated body's field names back to Ollama's."""
    param, message = error.param, error.message
    if param is not None and renamed is not None:
        head = param.split(".", 1)[0].split("[", 1)[0]
        if head in renamed:
            ollama_param = renamed[head] + param[len(head):]
            message = message.replace(param, ollama_param, 1) if param in message else message
            param = ollama_param
    if param is not None and param not in message:
        message = f"{param}: {message}"
    return JSONResponse({"error": message}, status_code=error.status, headers=error.headers)


Route = Callable[[Request], Awaitable[Response]]


def ollama_route(handler: Route) -> Route:
    """`handler` behind the API key, its errors in Ollama's shape."""
    async def route(request: Request) -> Response:
        try:
            await routes.require_api_key(request)
            return await handler(request)
        except APIError as error:
            return error_response(error)
    return route


def keep_alive_s(value: str | float | None) -> float | None:
    """A request's keep_alive in seconds (-1: keep loaded; None: not given, the server's); a
    400 naming keep_alive for what is neither a duration nor a number of seconds."""
    if value is None:
        return None
    seconds = value
    if isinstance(value, str):
        duration = _DURATION.fullmatch(value)
        if _SECONDS.fullmatch(value):
            seconds = float(value)
        elif duration is not None:
            seconds = sum(float(n) * _UNIT_S[unit] for n, unit in _DURATION_PART.findall(duration[2]))
            seconds = -seconds if duration[1] == "-" else seconds
        else:
            seconds = math.nan
    if not math.isfinite(seconds):
        raise bad_request(f"keep_alive must be a duration (5m, 1h30m, -1) or a number of seconds; got "
                          f"{value!r}", "keep_alive")
    return -1.0 if seconds < 0 else float(seconds)


# -- the body as a chat or completion request -----------------------------------------------------

def _sampling(options: OllamaOptions | None) -> dict[str, Any]:
    """Ollama's options under our names; Ollama's defaults where none is given."""
    given = options.model_dump(exclude_none=True) if options is not None else {}
    if given.get("repeat_last_n", -1) not in (-1, 0):
        raise bad_request("repeat_last_n must be -1 (the whole context, the one window nanoserve's "
                          f"penalties have) or 0 (no penalty); got {given['repeat_last_n']}",
                          "options.repeat_last_n")
    fields = {name: given[name] for name in SAME_NAMED_OPTIONS if name in given}
    if "repeat_penalty" in given and given.get("repeat_last_n") != 0:
        fields["repetition_penalty"] = given["repeat_penalty"]
    if given.get("num_predict") is not None and given["num_predict"] not in (-1, -2):
        fields["max_tokens"] = given["num_predict"]
    for name, value in OLLAMA_DEFAULTS.items():
        if name not in fields and not (given.get("mirostat") and name in ("top_k", "top_p")):
            fields[name] = value
    return fields


def _format(value: str | dict[str, Any] | None) -> dict[str, Any]:
    if not value:
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}}


def _think(state: ServerState, think: bool | str | None) -> dict[str, Any]:
    if think is None:
        return {}
    if isinstance(think, str):
        raise bad_request(f'think levels ("{think}") are not supported: send true or false', "think",
                          code="unsupported")
    if not think:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if state.reasoning.tags(state.engine.tokenizer) is None:
        raise bad_request("this model does not support thinking here: serve it with --reasoning-parser",
                          "think", code="unsupported")
    return {"include_reasoning": True}


def _common(body: GenerationFields, model: str) -> dict[str, Any]:
    """The fields every translation shares; its checks read the body alone."""
    common = {"model": model, **_sampling(body.options), **_format(body.format)}
    if body.logprobs:
        common.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    elif body.top_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return common


def _message(message: OllamaMessage, index: int) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.thinking:
        turn["reasoning_content"] = message.thinking
    if message.tool_calls:
        turn["tool_calls"] = [{"id": call.id or f"call_{index}_{i}", "type": "function", "function": {
            "name": call.function.name, "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}}
            for i, call in enumerate(message.tool_calls)]
    if message.tool_name:
        turn["name"] = message.tool_name
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _validated(model: type[ParsedBody], fields: dict[str, Any]) -> ParsedBody:
    """The translated body; a value our model refuses is a 400 naming its field."""
    try:
        return model.model_validate(fields)
    except ValidationError as error:
        raise from_validation_error(error.errors(include_url=False)) from None


def chat_request(state: ServerState, body: OllamaChatRequest, model: str) -> ChatCompletionRequest:
    chat = {**_common(body, model), **_think(state, body.think),
            "messages": [_message(m, i) for i, m in enumerate(body.messages)]}
    if body.tools:
        chat["tools"] = body.tools
    return _validated(ChatCompletionRequest, chat)


def generate_request(state: ServerState, body: OllamaGenerateRequest, model: str) -> RequestBody:
    """A chat of the system and the prompt through the model's template, or with raw (or for a
    model without a chat template, as Ollama's default template "{{ .Prompt }}") the prompt as
    it is (a completion)."""
    common = _common(body, model)
    if body.raw or state.engine.tokenizer.chat_template is None:
        if body.system or body.think:
            raise bad_request("a raw prompt (or a model without a chat template) takes no system message "
                              "and no think: there is no template to place them",
                              "system" if body.system else "think")
        if common.pop("logprobs", False):
            common["logprobs"] = common.pop("top_logprobs")
        return _validated(CompletionRequest, {**common, "prompt": body.prompt})
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": body.prompt}]
    return _validated(ChatCompletionRequest, {**common, **_think(state, body.think), "messages": messages})


async def _fit_window(state: ServerState, options: OllamaOptions | None, translated: RequestBody) -> None:
    """Ollama generates until the context is full when num_predict is unset; num_ctx, if given,
    is the request's window (at most the model's context). Where the room left matters, the
    prompt is measured and max_tokens cut to that room."""
    num_ctx = options.num_ctx if options is not None else None
    context = state.engine.max_model_len
    if num_ctx is not None and num_ctx > context:
        raise bad_request(f"num_ctx must be at most this model's context, {context}; got {num_ctx}",
                          "options.num_ctx")
    window = num_ctx if num_ctx is not None and num_ctx < context else None
    if window is None and not (isinstance(translated, CompletionRequest) and translated.max_tokens is None):
        return  # a chat without max_tokens gets the room left in the context from planning
    kind: Kind = "completion" if isinstance(translated, CompletionRequest) else "chat"
    # Seeded: an unseeded probe would take one of `serve --seed`'s seeds from the next request.
    probe = translated.model_copy(update={"max_tokens": 1, "seed": 0})
    prompt = len((await asyncio.to_thread(planning.plan, state, kind, probe))[0].prompt_ids)
    room = (window or state.engine.scheduler.max_request_tokens) - prompt
    if room < 1:
        raise bad_request(f"the prompt has {prompt} tokens, which leaves no room to generate in "
                          f"{'num_ctx ' + str(window) if window else 'the context'}",
                          "options.num_ctx" if window else "prompt")
    limit = state.limits.max_tokens
    asked = translated.max_tokens
    translated.max_tokens = min(asked, room) if asked is not None else min(room, limit or room)


# -- the answers ----------------------------------------------------------------------------------

class NDJSONResponse(EventStreamResponse):
    """One JSON object a line (Ollama's streams); aborts the generation however it ends."""

    media_type = "application/x-ndjson"


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"


def ns(seconds: float) -> int:
    return max(0, round(seconds * NS_PER_S))


def _done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


def _ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls as Ollama's (arguments an object); a call cut before its arguments
    closed is left out."""
    out = []
    for i, call in enumerate(calls):
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:
            continue
        out.append({"id": call.get("id"), "function": {"index": i, "name": call["function"]["name"],
                                                       "arguments": arguments}})
    return out


def _legacy_logprobs(logprobs: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The completions format (tokens, token_logprobs, top_logprobs maps) as Ollama's records."""
    if logprobs is None:
        return None
    return [{"token": token, "logprob": logprob,
             "top_logprobs": [{"token": t, "logprob": lp} for t, lp in (top or {}).items()]}
            for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                           logprobs["top_logprobs"], strict=True)]


class Shape:
    """How one route's pieces look: /api/chat puts text in message.content, /api/generate in
    response; `kind` is the translated request's; `arrival_s` when the request came (None: when
    its generation started) and `load_s` how long it waited for the load it started."""

    def __init__(self, route: Literal["chat", "generate"], kind: Kind, model: str, *,
                 arrival_s: float | None = None, load_s: float = 0.0) -> None:
        self.route, self.kind, self.model = route, kind, model
        self.arrival_s, self.load_s = arrival_s, load_s

    def piece(self, text: str, thinking: str = "", calls: list[dict[str, Any]] | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        piece: dict[str, Any] = {"model": self.model, "created_at": timestamp()}
        if self.route == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            message.update({"thinking": thinking} if thinking else {})
            message.update({"tool_calls": calls} if calls else {})
            piece["message"] = message
        else:
            piece["response"] = text
            piece.update({"thinking": thinking} if thinking else {})
            piece.update({"tool_calls": calls} if calls else {})
        piece["done"] = False
        piece.update({"logprobs": logprobs} if logprobs else {})
        return piece

    def done(self, generation: Generation, finish_reason: str | None, **content: Any) -> dict[str, Any]:
        return {**self.piece(content.pop("text", ""), **content), "done": True,
                "done_reason": _done_reason(finish_reason), **self._metrics(generation)}

    def ended(self, done_reason: Literal["load", "unload"]) -> dict[str, Any]:
        """The one reply of a request with nothing to generate (Ollama's load and unload)."""
        return {**self.piece(""), "done": True, "done_reason": done_reason,
                "total_duration": ns(time.perf_counter() - self.arrival_s), "load_duration": ns(self.load_s)}

    def _metrics(self, generation: Generation) -> dict[str, int]:
        """Ollama's timings (nanoseconds) and counts: the whole from the request's arrival (its
        load included), the prompt's evaluation from the generation's start to the first token,
        the generation's from the first token to the last."""
        choice = next(iter(generation.choices.values()))
        now = time.perf_counter()
        first = choice.first_s or now
        usage = generation.usage()
        arrival_s = generation.arrival_s if self.arrival_s is None else self.arrival_s
        return {"total_duration": ns(now - arrival_s), "load_duration": ns(self.load_s),
                "prompt_eval_count": usage["prompt_tokens"],
                "prompt_eval_duration": ns(first - generation.arrival_s),
                "eval_count": usage["completion_tokens"], "eval_duration": ns((choice.last_s or now) - first)}

    def whole(self, body: dict[str, Any], generation: Generation) -> dict[str, Any]:
        """The unary chat or completion body as one Ollama reply."""
        choice = body["choices"][0]
        if self.kind == "completion":
            return self.done(generation, choice["finish_reason"], text=choice["text"],
                             logprobs=_legacy_logprobs(choice.get("logprobs")))
        message = choice["message"]
        return self.done(generation, choice["finish_reason"], text=message["content"] or "",
                         thinking=message.get("reasoning_content") or "",
                         calls=_ollama_calls(message.get("tool_calls") or []),
                         logprobs=(choice.get("logprobs") or {}).get("content"))

    async def lines(self, generation: Generation) -> AsyncIterator[str]:
        calls: dict[int, dict[str, Any]] = {}
        finish_reason = None
        try:
            async for batch in chunk_batches(self.kind, generation, {}):
                for chunk in batch or ():  # None: a quiet interval; NDJSON has no comment to send
                    choice = chunk["choices"][0]
                    finish_reason = choice["finish_reason"] or finish_reason
                    if (line := self._delta_line(choice, calls)) is not None:
                        yield line
            if generation.error is not None:
                yield _line({"error": str(generation.error)})
                return
            if calls:
                yield _line(self.piece("", calls=_ollama_calls([calls[i] for i in sorted(calls)])))
            yield _line(self.done(generation, finish_reason))
        except Exception as error:  # a bug: the client still gets a well-formed end of stream
            yield _line({"error": f"internal error: {type(error).__name__}"})

    def _delta_line(self, choice: dict[str, Any], calls: dict[int, dict[str, Any]]) -> str | None:
        if self.kind == "completion":
            logprobs = _legacy_logprobs(choice.get("logprobs"))
            if not (choice["text"] or logprobs):
                return None
            return _line(self.piece(choice["text"], logprobs=logprobs))
        delta = choice["delta"]
        for call in delta.get("tool_calls", []):
            known = calls.setdefault(call["index"], {"id": call.get("id"),
                                                     "function": {"name": "", "arguments": ""}})
            known["function"]["name"] += call.get("function", {}).get("name") or ""
            known["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
        text, thinking = delta.get("content") or "", delta.get("reasoning_content") or ""
        logprobs = (choice.get("logprobs") or {}).get("content")
        if not (text or thinking or logprobs):
            return None
        return _line(self.piece(text, thinking, logprobs=logprobs))


def _answer(shape: Shape, stream: bool) -> routes.Answer:
    async def answer(request: Request, generation: Generation, _: str) -> Response:
        if stream:
            return NDJSONResponse(shape.lines(generation), on_close=generation.close)
        return await unary_response(request, shape.kind, generation, shape.model,
                                    translate=lambda body: shape.whole(body, generation))
    return answer


# -- the routes -----------------------------------------------------------------------------------

async def _bind(request: Request, model: ServedModel) -> tuple[ServerState, float]:
    """Bind the request to `model` as the OpenAI routes do (one not loaded loads now, and the
    request waits); and the seconds it waited for that load when it started it (else 0)."""
    starts_load = model.status == "available"
    started_s = time.perf_counter()
    state = await routes.bind_model(request, model.name)
    return state, time.perf_counter() - started_s if starts_load else 0.0


def _unload(state: ServerState, model: ServedModel, shape: Shape) -> Response:
    """Ollama's way to unload a model: nothing to generate and keep_alive 0. It goes as soon as
    no request runs on it; one not loaded is left as it is (nothing loads for the asking)."""
    if model.pinned:
        raise bad_request("this server's one model is loaded for good (nanoserve serve --model M): "
                          "keep_alive 0 cannot unload it; a server of several models (--models-dir, or "
                          "--model more than once) unloads them", "keep_alive")
    if model.bridge is not None:
        state.models.keep_alive(model.name, 0)
    return JSONResponse(shape.ended("unload"))


async def _generation(request: Request, route: Literal["chat", "generate"]) -> Response:
    arrival_s = time.perf_counter()
    server = state_of(request)
    model_type = OllamaChatRequest if route == "chat" else OllamaGenerateRequest
    body = await routes.read_body(request, model_type)
    model, served = ollama_models.find(server, body.model)
    keep_s = keep_alive_s(body.keep_alive)
    _common(body, served)  # the body's own checks, before its model loads for it
    shape = Shape(route, "chat", body.model, arrival_s=arrival_s)
    empty = not body.messages if route == "chat" else not body.prompt
    if empty and keep_s == 0:
        return _unload(server, model, shape)
    state, shape.load_s = await _bind(request, model)
    routes.check_available(state)
    if empty:  # Ollama's way to load a model: nothing to generate, the model is ready
        server.models.keep_alive(model.name, keep_s)
        return JSONResponse(shape.ended("load"))
    try:
        translated = (chat_request(state, body, served) if route == "chat"
                      else generate_request(state, body, served))
        await _fit_window(state, body.options, translated)
        shape.kind = "completion" if isinstance(translated, CompletionRequest) else "chat"
        server.models.keep_alive(model.name, keep_s)
        return await routes.serve_generation(request, shape.kind, translated, _answer(shape, body.stream))
    except APIError as error:
        prompt_field = {"messages": "messages" if route == "chat" else "prompt"}
        return error_response(error, OLLAMA_PARAMS | prompt_field)


@ollama_route
async def chat(request: Request) -> Response:
    return await _generation(request, "chat")


@ollama_route
async def generate(request: Request) -> Response:
    return await _generation(request, "generate")


@ollama_route
async def embed(request: Request) -> Response:
    arrival_s = time.perf_counter()
    server = state_of(request)
    body = await routes.read_body(request, OllamaEmbedRequest)
    model, served = ollama_models.find(server, body.model)
    keep_s = keep_alive_s(body.keep_alive)
    sent = body.options.model_dump(exclude_none=True) if body.options is not None else {}
    num_ctx = sent.pop("num_ctx", None)
    if sent:
        name = next(iter(sent))
        raise bad_request(f"{name} is a sampling option: an embedding samples nothing", f"options.{name}")
    state, load_s = await _bind(request, model)
    routes.check_available(state)
    if num_ctx is not None and num_ctx > state.engine.max_model_len:
        raise bad_request(f"num_ctx must be at most this model's context, {state.engine.max_model_len}; got "
                          f"{num_ctx}", "options.num_ctx")
    server.models.keep_alive(model.name, keep_s)
    openai_body = embeddings.EmbeddingRequest.model_validate(
        {"model": served, "input": body.input, "dimensions": body.dimensions})
    generation = await embeddings.run(request, openai_body, arrival_s)
    if generation is None:
        return Response(status_code=499)
    vectors = [choice.embedding for choice in sorted(generation.choices.values(), key=lambda c: c.index)]
    return JSONResponse({"model": body.model, "embeddings": vectors,
                         "total_duration": ns(time.perf_counter() - arrival_s), "load_duration": ns(load_s),
                         "prompt_eval_count": generation.usage()["prompt_tokens"]})


@ollama_route
async def tags(request: Request) -> Response:
    listed = ollama_models.listing(state_of(request), loaded_only=False)
    return JSONResponse(await asyncio.to_thread(ollama_models.tags_body, listed))


@ollama_route
async def ps(request: Request) -> Response:
    state = state_of(request)
    listed = ollama_models.listing(state, loaded_only=True)
    unloads_in_s = ollama_models.unloads_in(state, listed)
    return JSONResponse(await asyncio.to_thread(ollama_models.ps_body, listed, unloads_in_s))


@ollama_route
async def show(request: Request) -> Response:
    """A served model's description, loaded or not: nothing loads for it."""
    server = state_of(request)
    body = await routes.read_body(request, OllamaShowRequest)
    model, served = ollama_models.find(server, body.model or body.name)
    engine, config = ollama_models.reading(server, model)

    def read() -> dict[str, Any]:
        return ollama_models.show_body(server, served, ollama_models.describe(model.name, engine, config))

    return JSONResponse(await asyncio.to_thread(read))


@ollama_route
async def version(_: Request) -> Response:
    return JSONResponse(ollama_models.version_body())
