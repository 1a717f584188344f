"""Anthropic's Messages API on /v1/messages, as vLLM and llama.cpp serve it.

Owns: the request models (`system`, `messages` with text, tool_use, tool_result and thinking
blocks, `max_tokens`, `stop_sequences`, `temperature`, `top_k`, `top_p`, `tools`,
`tool_choice`, `thinking`, `output_config.format`, `stream`, `metadata.user_id`) and
`MESSAGES_REFUSED`, the fields refused by name; the body as a chat completion request
(`as_chat_request`), so planning, generation and the tool and reasoning readers are the chat
endpoint's own; the chat completion's answer in Anthropic's shapes: the message body, the
stream's events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop, ping, error), and errors as `{"type": "error", "error": {...}}`; the key in
`x-api-key` (Anthropic's clients) or `Authorization: Bearer`.
Also /v1/messages/count_tokens: the prompt tokens a Messages request's system, messages and
tools come to (`CountTokensRequest`, the request less what only generation reads), counted by
the planning a generation runs.
Refuses: documents, server tools, containers and MCP (named 400s).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from nanoserve.server import planning
from nanoserve.server.errors import APIError, bad_request
from nanoserve.server.generation import Generation, unary_response
from nanoserve.server.openai import routes
from nanoserve.server.openai.protocol import (
    ChatCompletionRequest,
    OpenAIModel,
    Refusal,
    absent_or,
    empty_or_absent,
)
from nanoserve.server.openai.streaming import EventStreamResponse, chunk_batches
from nanoserve.server.state import state_of, unavailable
from nanoserve.server.translated_chat import chat_body, function_tool

log = logging.getLogger("nanoserve.server")

_NOT_SERVED = "is not served here"

MESSAGES_REFUSED: dict[str, Refusal] = {
    "container": Refusal("containers (code execution) are not supported"),
    "mcp_servers": Refusal("MCP servers are not supported", empty_or_absent),
    "context_management": Refusal("context management is not supported"),
    "diagnostics": Refusal("diagnostics are not supported"),
    "inference_geo": Refusal("inference_geo is not supported: the model runs where this server runs"),
    "speed": Refusal("speed modes are not supported", absent_or("standard")),
    "user_profile_id": Refusal("user profiles are not supported"),
    "workspace_id": Refusal("workspaces are not supported"),
    "service_tier": Refusal("service tiers are not supported", absent_or("auto", "standard_only")),
    "output_config.effort": Refusal("effort is not supported; thinking.budget_tokens bounds the thinking"),
    "messages[].content[].citations": Refusal("citations are not supported", empty_or_absent),
    "messages[].content[].caller": Refusal("programmatic tool callers are not supported"),
    "messages[].content[].toolset_name": Refusal("toolsets are not supported"),
    "messages[].content[].transformations": Refusal("image blocks are not supported (text only)"),
    "system[].citations": Refusal("citations are not supported", empty_or_absent),
    "tools[].allowed_callers": Refusal("programmatic tool callers are not supported", empty_or_absent),
    "tools[].defer_loading": Refusal("deferred tool loading is not supported", absent_or(False)),
    "tools[].input_examples": Refusal("tool input examples are not supported", empty_or_absent),
    "tools[].strict": Refusal("strict tools are not supported: tool_choice any or tool constrains "
                              "the input to the schema", absent_or(False)),
    "tools[].eager_input_streaming": Refusal("eager input streaming is not supported", absent_or(False)),
}
BLOCK_FIELDS = {"text": {"text"}, "tool_use": {"id", "name", "input"},
                "tool_result": {"tool_use_id", "content", "is_error"},
                "thinking": {"thinking", "signature"}, "redacted_thinking": {"data"}, "image": {"source"}}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a hint: the prefix cache keeps prompts anyway


class ImageSource(OpenAIModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None  # base64
    url: str | None = None  # http(s) from an allowed host

    def chat_url(self) -> str:
        """The image as a chat image_url's URL."""
        if self.type == "url":
            return self.url or ""
        return f"data:{self.media_type or 'image/png'};base64,{self.data or ''}"


class ContentBlock(OpenAIModel):
    """One block of a message: the fields of each type are checked in `_block_fields`."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    source: ImageSource | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicMessage(OpenAIModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class AnthropicTool(OpenAIModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(OpenAIModel):
    user_id: str | None = None


class Thinking(OpenAIModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    format: OutputFormat | None = None


class MessagesRequest(OpenAIModel):
    refused_fields: ClassVar[dict[str, Refusal]] = MESSAGES_REFUSED

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    cache_control: dict[str, Any] | None = None


class CountTokensRequest(OpenAIModel):
    """/v1/messages/count_tokens: what shapes the prompt (no max_tokens, sampling or stream)."""

    refused_fields: ClassVar[dict[str, Refusal]] = MESSAGES_REFUSED

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None


# -- the request as a chat completion -------------------------------------------------------------

def as_chat_request(body: MessagesRequest, images_refused: str | None = None) -> ChatCompletionRequest:
    """The chat completion request this body asks for; a 400 naming the field for what has no
    counterpart (an image block, with `images_refused` the reason)."""
    options = {"max_tokens": body.max_tokens, "stop": body.stop_sequences, "temperature": body.temperature,
               "top_p": body.top_p, "top_k": body.top_k, "user": body.metadata and body.metadata.user_id}
    tools = [function_tool(tool.name, tool.input_schema, tool.description) for tool in body.tools or []]
    chat = chat_body(body.model, _system(body.system) + _messages(body.messages, images_refused),
                     stream=body.stream, options=options, tools=tools)
    if body.messages[-1].role == "assistant":  # Anthropic's prefill: the reply continues that turn
        chat.update(continue_final_message=True, add_generation_prompt=False)
    if body.tool_choice is not None:
        chat.update(_tool_choice(body.tool_choice))
    chat.update(_thinking(body.thinking))
    if body.output_config is not None and body.output_config.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    return ChatCompletionRequest.model_validate(chat)


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    return [{"role": "system", "content": system if isinstance(system, str)
             else "".join(block.text for block in system)}]


def _messages(messages: list[AnthropicMessage], images_refused: str | None) -> list[dict[str, Any]]:
    chat = []
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
            continue
        for j, block in enumerate(message.content):
            _block_fields(block, message.role, f"messages[{i}].content[{j}]")
            if block.type == "image" and images_refused is not None:
                raise bad_request(images_refused, f"messages[{i}].content[{j}].source", code="unsupported")
        chat += _message_turns(message)
    return chat


def _block_fields(block: ContentBlock, role: str, where: str) -> None:
    allowed = BLOCK_FIELDS.get(block.type)
    if allowed is None:
        raise bad_request(f"content blocks of type {block.type!r} are not supported (text, image, tool_use, "
                          "tool_result, thinking)", f"{where}.type", code="unsupported")
    stray = sorted(set(block.model_fields_set) - allowed - {"type", "cache_control"})
    if stray:
        raise bad_request(f"a {block.type} block has no field {stray[0]!r}", f"{where}.{stray[0]}")
    needed = {"text": ["text"], "tool_use": ["id", "name", "input"], "tool_result": ["tool_use_id"],
              "image": ["source"]}
    missing = [name for name in needed.get(block.type, []) if getattr(block, name) is None]
    if missing:
        raise bad_request(f"a {block.type} block needs {missing[0]}", f"{where}.{missing[0]}")
    owner = {"tool_use": "assistant", "thinking": "assistant", "redacted_thinking": "assistant",
             "tool_result": "user", "image": "user"}.get(block.type)
    if owner is not None and role != owner:
        raise bad_request(f"{block.type} blocks belong to {owner} messages", f"{where}.type")


def _message_turns(message: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message as chat turns: tool results become tool messages (ahead of the
    user's text), tool_use blocks the assistant's tool calls, thinking its reasoning_content."""
    blocks = message.content
    text = "".join(block.text for block in blocks if block.type == "text")
    results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)}
               for block in blocks if block.type == "tool_result"]
    if message.role != "assistant":
        if any(block.type == "image" for block in blocks):  # text and image parts, in order
            parts = [{"type": "text", "text": block.text} if block.type == "text"
                     else {"type": "image_url", "image_url": {"url": block.source.chat_url()}}
                     for block in blocks if block.type in ("text", "image")]
            return [*results, {"role": message.role, "content": parts}]
        return results + ([{"role": message.role, "content": text}] if text or not results else [])
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": block.id, "type": "function", "function": {
        "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
        for block in blocks if block.type == "tool_use"]
    if calls:
        turn["tool_calls"] = calls
    thinking = "".join(block.thinking or "" for block in blocks if block.type == "thinking")
    if thinking:
        turn["reasoning_content"] = thinking
    return [turn]


def _result_text(block: ContentBlock) -> str:
    content = block.content
    text = content if isinstance(content, str) else "".join(part.text for part in content or [])
    return f"Error: {text}" if block.is_error else text


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request('tool_choice of type "tool" needs the tool\'s name', "tool_choice.name")
        chat: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice.name}}}
    else:
        chat = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[choice.type]}
    if choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    return chat


def _thinking(thinking: Thinking | None) -> dict[str, Any]:
    """Anthropic's thinking switch as the chat's: a budget, a template told not to think, the
    thinking left out of the reply (display: omitted)."""
    if thinking is None:
        return {}
    if thinking.type == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    chat: dict[str, Any] = {"include_reasoning": thinking.display != "omitted"}
    if thinking.budget_tokens is not None:
        chat["thinking_token_budget"] = thinking.budget_tokens
    return chat


# -- the answer -----------------------------------------------------------------------------------

def message_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's body as an Anthropic message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    calls = [block for call in message.get("tool_calls") or [] if (block := _tool_use(call)) is not None]
    if message["content"] or not calls:
        content.append({"type": "text", "text": message["content"] or ""})
    content += calls
    return {"id": "msg_" + chat["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant",
            "model": chat["model"], "content": content, **_stop(choice), "usage": _usage(chat["usage"])}


def _tool_use(call: dict[str, Any]) -> dict[str, Any] | None:
    """A tool call as a tool_use block; None for one max_tokens cut before its input closed."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        return None
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}


def _stop(choice: dict[str, Any]) -> dict[str, Any]:
    stop = choice["stop_reason"]
    if choice["finish_reason"] == "stop" and isinstance(stop, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop}
    return {"stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"), "stop_sequence": None}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


# Anthropic's own error types by status (its docs' "Errors" page), not OpenAI's: a client that
# branches on `error.type` looks for `rate_limit_error`, never OpenAI's `requests`.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 504: "timeout_error",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_response(error: APIError) -> JSONResponse:
    body = {"type": "error", "error": {"type": error_type(error.status),
                                       "message": error.message, "param": error.param}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


# -- the routes -----------------------------------------------------------------------------------

async def count_tokens(request: Request) -> Response:
    try:
        await _check_key(request)
        body = await routes.parse_body(request, CountTokensRequest)
        state = state_of(request)
        planning.check_model(state, body.model)
        routes.check_available(state)
        chat = as_chat_request(MessagesRequest.model_validate({
            **body.model_dump(exclude_none=True, by_alias=True), "max_tokens": 1}))
        plan = await asyncio.to_thread(planning.plan, state, "chat", chat)
        return JSONResponse({"input_tokens": len(plan[0].prompt_ids)})
    except APIError as error:
        return error_response(error)


async def create_message(request: Request) -> Response:
    try:
        await _check_key(request)
        body = await routes.parse_body(request, MessagesRequest)
        chat = as_chat_request(body, state_of(request).image_refusal())
        return await routes.serve_generation(request, "chat", chat, _answer(chat))
    except APIError as error:
        return error_response(error)


async def _check_key(request: Request) -> None:
    """Anthropic's clients send the key as x-api-key; a Bearer token works as on /v1. Either
    names the request's tenant, as `routes.require_api_key` does."""
    tenancy = state_of(request).tenancy
    given = request.headers.get("x-api-key")
    if given is not None and tenancy.guarded:
        tenant = tenancy.find(given.strip())
        if tenant is None:
            raise APIError(401, "incorrect API key in x-api-key", code="invalid_api_key")
        request.state.tenant = tenant
        return
    try:
        await routes.require_api_key(request)
    except APIError:
        raise APIError(401, "missing or incorrect API key: send 'x-api-key: <key>'",
                       code="invalid_api_key") from None


def _answer(chat: ChatCompletionRequest) -> routes.Answer:
    async def answer(request: Request, generation: Generation, model: str) -> Response:
        if chat.stream:
            return EventStreamResponse(_events(generation, model), on_close=generation.close)
        return await unary_response(request, "chat", generation, model, translate=message_body)
    return answer


def event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(generation: Generation, model: str) -> AsyncIterator[str]:
    message_id = "msg_" + generation.request_id.removeprefix("chatcmpl-")
    usage = _usage(generation.usage())
    yield event("message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}})
    blocks = _BlockStream()
    try:
        async for batch in chunk_batches("chat", generation, {}):
            if batch is None:
                yield event("ping", {"type": "ping"})
                continue
            yield "".join(blocks.events(choice) for chunk in batch for choice in chunk["choices"])
        if generation.error is not None:
            yield _error_event(unavailable(str(generation.error), generation.state.limits))
            return
        yield blocks.close()
        yield event("message_delta", {"type": "message_delta", "delta": _stop(blocks.finish),
                                      "usage": {"output_tokens": generation.usage()["completion_tokens"]}})
        yield event("message_stop", {"type": "message_stop"})
    except Exception as error:  # a bug: the client still gets a well-formed end of stream
        log.exception("error while streaming %s", generation.request_id)
        yield _error_event(APIError(500, f"internal error: {type(error).__name__}"))


def _error_event(error: APIError) -> str:
    return event("error", {"type": "error", "error": {
        "type": error_type(error.status), "message": error.message}})


class _BlockStream:
    """Chat deltas into content blocks: each kind of delta opens its block, closing the last."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.finish: dict[str, Any] = {}

    def events(self, choice: dict[str, Any]) -> str:
        delta, out = choice["delta"], []
        if delta.get("reasoning_content"):
            out += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._into("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                out += self._into("tool_use", {"type": "tool_use", "id": call["id"],
                                               "name": call["function"]["name"], "input": {}}, new=True)
            if call.get("function", {}).get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": call["function"]["arguments"]}))
        if choice["finish_reason"] is not None:
            self.finish = choice
        return "".join(out)

    def _into(self, kind: str, start: dict[str, Any], *, new: bool = False) -> list[str]:
        if self.open == kind and not new:
            return []
        out = [self.close()] if self.open is not None else []
        self.index, self.open = self.index + 1, kind
        return [*out, event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": start})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta",
                     {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})
