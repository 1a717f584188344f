"""OpenAI's Responses API on /v1/responses, stateless.

Owns: the request models (`input` as a string or items: messages, `function_call`,
`function_call_output` and `reasoning` items; `instructions`, `max_output_tokens`,
`temperature`, `top_p`, `tools`, `tool_choice`, `parallel_tool_calls`, `text.format`, `stream`,
`user`, `safety_identifier`) and `RESPONSES_REFUSED`, the fields refused by name (`store: true`,
`previous_response_id`, `background` and `conversation` among them: nothing is kept between
requests); the body as a chat completion request (`as_chat_request`), so planning, generation
and the tool and reasoning readers are the chat endpoint's own; the chat completion's answer as
a response object (reasoning, message and function_call output items) and as the Responses
stream's events (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta / .done, response.reasoning_text.delta
/ .done, response.function_call_arguments.delta / .done, response.content_part.done,
response.output_item.done, response.completed (its status "incomplete" when max_output_tokens
cut it); error).
Refuses: built-in tools (web search, file search, computer, MCP...), images and files.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from nanoserve.server.errors import bad_request
from nanoserve.server.generation import Generation, unary_response
from nanoserve.server.openai import routes
from nanoserve.server.openai.protocol import (
    ChatCompletionRequest,
    OpenAIModel,
    Refusal,
    absent_or,
    empty_or_absent,
    now_s,
)
from nanoserve.server.openai.streaming import EventStreamResponse, chunk_batches
from nanoserve.server.state import state_of, unavailable
from nanoserve.server.translated_chat import chat_body, function_tool

log = logging.getLogger("nanoserve.server")

_STATELESS = "this server keeps nothing between requests: send the whole conversation as input"

RESPONSES_REFUSED: dict[str, Refusal] = {
    "store": Refusal("stored responses are not supported: " + _STATELESS, absent_or(False)),
    "previous_response_id": Refusal("previous_response_id is not supported: " + _STATELESS),
    "conversation": Refusal("conversations are not supported: " + _STATELESS),
    "background": Refusal("background mode is not supported: responses are answered while the "
                          "client waits (or streams)", absent_or(False)),
    "background_options": Refusal("background mode is not supported"),
    "include": Refusal("include is not supported: the output carries what this server produces",
                       empty_or_absent),
    "metadata": Refusal("metadata belongs to stored responses, which are not supported", empty_or_absent),
    "max_tool_calls": Refusal("max_tool_calls is not supported: only function tools, which the client runs"),
    "prompt": Refusal("prompt templates are not supported"),
    "prompt_cache_key": Refusal("prompt_cache_key is not supported: the prefix cache needs no hint"),
    "prompt_cache_retention": Refusal("prompt_cache_retention is not supported"),
    "prompt_cache_options": Refusal("prompt_cache_options are not supported"),
    "service_tier": Refusal("service tiers are not supported", absent_or("auto", "default")),
    "truncation": Refusal("truncation is not supported: a prompt over the context is a 400",
                          absent_or("disabled")),
    "top_logprobs": Refusal("top_logprobs is not supported on /v1/responses", absent_or(0)),
    "moderation": Refusal("moderation is not supported"),
    "image": Refusal("image generation is not supported"),
    "access_programs": Refusal("access programs are not supported"),
    "context_management": Refusal("context management is not supported"),
    "stream_options.include_obfuscation": Refusal("stream obfuscation is not supported", absent_or(False)),
    "reasoning.effort": Refusal("reasoning effort is not supported; chat_template_kwargs switches "
                                "thinking in templates that read them"),
    "reasoning.summary": Refusal("reasoning summaries are not supported: reasoning items carry the "
                                 "thinking itself"),
    "reasoning.generate_summary": Refusal("reasoning summaries are not supported"),
    "reasoning.context": Refusal("reasoning context across turns is not supported: " + _STATELESS),
    "reasoning.mode": Refusal("reasoning modes are not supported"),
    "text.verbosity": Refusal("verbosity is not supported"),
    "input[].phase": Refusal("message phases are not supported"),
    "input[].caller": Refusal("programmatic tool callers are not supported"),
    "input[].namespace": Refusal("tool namespaces are not supported"),
    "input[].async": Refusal("async tool calls are not supported", absent_or(False)),
    "input[].encrypted_content": Refusal("encrypted reasoning is not supported"),
    "input[].content[].file_id": Refusal("only text content is supported"),
    "input[].content[].file_data": Refusal("only text content is supported"),
    "input[].content[].file_url": Refusal("only text content is supported"),
    "input[].content[].filename": Refusal("only text content is supported"),
    "input[].content[].detail": Refusal("image detail levels are not supported: an image is processed as "
                                        "its model's processor does", absent_or("auto")),
    "input[].content[].annotations": Refusal("annotations in the input are not supported", empty_or_absent),
    "input[].content[].logprobs": Refusal("logprobs in the input are not supported", empty_or_absent),
    "input[].content[].prompt_cache_breakpoint": Refusal("prompt cache breakpoints are not supported: "
                                                         "the prefix cache needs no hint"),
    "tools[].allowed_callers": Refusal("programmatic tool callers are not supported", empty_or_absent),
    "tools[].async": Refusal("async tools are not supported", absent_or(False)),
    "tools[].defer_loading": Refusal("deferred tool loading is not supported", absent_or(False)),
    "tools[].output_schema": Refusal("tool output schemas are not supported"),
}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None
    image_url: str | None = None  # an input_image's: a data: URL, or http(s) from an allowed host


class InputItem(OpenAIModel):
    """One item of `input`; which fields each type takes is checked in `_item_turns`."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar holds required and named calls to the schema either way


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ReasoningOptions(OpenAIModel):
    """OpenAI's reasoning options: effort and summaries are refused by name (RESPONSES_REFUSED)."""


class StreamOptions(OpenAIModel):
    """include_obfuscation is refused unless false (RESPONSES_REFUSED)."""


class ResponsesRequest(OpenAIModel):
    refused_fields: ClassVar[dict[str, Refusal]] = RESPONSES_REFUSED

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None


# -- the request as a chat completion -------------------------------------------------------------

def as_chat_request(body: ResponsesRequest, images_refused: str | None = None) -> ChatCompletionRequest:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages += _input_turns(body.input, images_refused)
    if not messages:
        raise bad_request("input is empty: give a string or at least one item", "input")
    options = {"max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
               "parallel_tool_calls": body.parallel_tool_calls, "user": body.user,
               "safety_identifier": body.safety_identifier}
    tools = [function_tool(tool.name, tool.parameters, tool.description) for tool in body.tools or []]
    chat = chat_body(body.model, messages, stream=body.stream, options=options, tools=tools)
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.format is not None:
        chat["response_format"] = _response_format(body.text.format)
    return ChatCompletionRequest.model_validate(chat)


def _input_turns(items: list[InputItem], images_refused: str | None = None) -> list[dict[str, Any]]:
    """Items as chat turns: consecutive function calls join one assistant turn, a reasoning
    item becomes the next assistant turn's reasoning_content."""
    turns: list[dict[str, Any]] = []
    reasoning = ""
    for i, item in enumerate(items):
        kind = item.type or "message"
        where = f"input[{i}]"
        if kind == "reasoning":
            reasoning += "".join(part.text or "" for part in [*(item.content or []), *(item.summary or [])])
        elif kind == "function_call":
            _need(item, where, "call_id", "name", "arguments")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if turns and turns[-1]["role"] == "assistant" and not turns[-1]["content"]:
                turns[-1].setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            _need(item, where, "call_id", "output")
            turns.append({"role": "tool", "tool_call_id": item.call_id,
                          "content": _text(item.output, f"{where}.output")})
        else:
            _need(item, where, "role", "content")
            turns.append({"role": item.role, "content": _content(item.content, f"{where}.content",
                                                                     images_refused)})
        if reasoning and turns and turns[-1]["role"] == "assistant" and kind != "reasoning":
            turns[-1]["reasoning_content"], reasoning = reasoning, ""
    return turns


def _need(item: InputItem, where: str, *names: str) -> None:
    for name in names:
        if getattr(item, name) is None:
            raise bad_request(f"a {item.type or 'message'} item needs {name}", f"{where}.{name}")


def _content(content: str | list[ContentPart], where: str,
             images_refused: str | None) -> str | list[dict[str, Any]]:
    """A message's content as chat content: its text, or with input_image parts the chat's text
    and image_url parts in the same order (refused naming the part, with `images_refused` the reason)."""
    if isinstance(content, str) or not any(part.type == "input_image" for part in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type != "input_image":
            parts.append({"type": "text", "text": _text([part], f"{where}[{j}]")})
        elif part.image_url is None:
            raise bad_request("an input_image part needs its image_url", f"{where}[{j}].image_url")
        elif images_refused is not None:
            raise bad_request(images_refused, f"{where}[{j}].image_url", code="unsupported")
        else:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


def _text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise bad_request(f"content parts of type {part.type!r} are not supported (text only)",
                              f"{where}[{j}]", code="unsupported")
    return "".join(part.text for part in content)


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice in ("none", "auto", "required"):
        return choice
    raise bad_request('tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                      "tool_choice")


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    if not text_format.name:
        raise bad_request("text.format of type json_schema needs a name", "text.format.name")
    schema = {"name": text_format.name, "schema": text_format.schema_ or {"type": "object"}}
    if text_format.strict is not None:
        schema["strict"] = text_format.strict
    return {"type": "json_schema", "json_schema": schema}


# -- the answer -----------------------------------------------------------------------------------

def response_body(chat: dict[str, Any], request: ResponsesRequest) -> dict[str, Any]:
    """A chat completion's body as a response object."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content") is not None:
        output.append(reasoning_item(_item_id("rs"), message["reasoning_content"]))
    if message["content"] or not message.get("tool_calls"):
        output.append(message_item(_item_id("msg"), message["content"] or ""))
    output += [function_call_item(_item_id("fc"), call["id"], call["function"]["name"],
                                  call["function"]["arguments"]) for call in message.get("tool_calls") or []]
    return _response(chat["id"], chat["model"], request, output, choice["finish_reason"],
                     _usage(chat["usage"]))


def _response(chat_id: str, model: str, request: ResponsesRequest, output: list[dict[str, Any]],
              finish_reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    status = {None: "in_progress", "length": "incomplete"}.get(finish_reason, "completed")
    return {"id": "resp_" + chat_id.removeprefix("chatcmpl-"), "object": "response", "created_at": now_s(),
            "status": status, "model": model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "tool_choice": request.tool_choice or "auto",
            "tools": [tool.model_dump(by_alias=True, exclude_none=True) for tool in request.tools or []],
            "text": {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)
                     if request.text and request.text.format else {"type": "text"}},
            "store": False, "background": False, "metadata": {}, "usage": usage}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_output_text(text)] if status == "completed" else []}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("completion_tokens_details") or {}
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


# -- the route ------------------------------------------------------------------------------------

async def create_response(request: Request) -> Response:
    body = await routes.parse_body(request, ResponsesRequest)
    chat = as_chat_request(body, state_of(request).image_refusal())

    async def answer(http: Request, generation: Generation, model: str) -> Response:
        if body.stream:
            return EventStreamResponse(_events(generation, model, body), on_close=generation.close)
        return await unary_response(http, "chat", generation, model,
                                    translate=lambda chat_body: response_body(chat_body, body))

    return await routes.serve_generation(request, "chat", chat, answer)


class _Events:
    """Numbered Responses stream events (sequence_number counts from 0)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, event_type: str, /, **fields: Any) -> str:
        payload = {"type": event_type, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event_type}\ndata: {data}\n\n"


async def _events(generation: Generation, model: str, request: ResponsesRequest) -> AsyncIterator[str]:
    emit = _Events()
    items = _ItemStream(emit)
    yield emit("response.created", response=_response(generation.request_id, model, request, [], None, None))
    yield emit("response.in_progress", response=_response(generation.request_id, model, request, [], None,
                                                          None))
    try:
        async for batch in chunk_batches("chat", generation, {}):
            if batch is not None:
                yield "".join(items.events(choice) for chunk in batch for choice in chunk["choices"])
        if generation.error is not None:
            error = unavailable(str(generation.error), generation.state.limits)
            yield emit("error", code=error.code, message=error.message, param=None)
            return
        yield items.close()
        final = _response(generation.request_id, model, request, items.output, items.finish_reason,
                          _usage(generation.usage()))
        # response.completed even when max_output_tokens cut it (status says so), as vLLM: the
        # openai client's stream helper takes its final response from that event alone.
        yield emit("response.completed", response=final)
    except Exception as error:  # a bug: the client still gets a well-formed end of stream
        log.exception("error while streaming %s", generation.request_id)
        yield emit("error", code="internal_error", message=f"internal error: {type(error).__name__}",
                   param=None)


class _ItemStream:
    """Chat deltas into output items: each kind of delta opens its item, closing the last."""

    def __init__(self, emit: _Events) -> None:
        self.emit = emit
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def events(self, choice: dict[str, Any]) -> str:
        delta, out = choice["delta"], []
        if delta.get("reasoning_content"):
            out += self._into("reasoning")
            out.append(self._text_delta("response.reasoning_text.delta", delta["reasoning_content"]))
        if delta.get("content"):
            out += self._into("message")
            out.append(self._text_delta("response.output_text.delta", delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                out += self._into("function_call", call["id"], call["function"]["name"])
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                self.open["arguments"] += arguments
                out.append(self.emit("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.output), delta=arguments))
        if choice["finish_reason"] is not None:
            self.finish_reason = choice["finish_reason"]
        return "".join(out)

    def _into(self, kind: str, call_id: str = "", name: str = "") -> list[str]:
        if self.open is not None and self.open["type"] == kind and kind != "function_call":
            return []
        out = [self.close()] if self.open is not None else []
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.open = {"type": kind, "id": _item_id(prefix), "text": "", "arguments": "", "call_id": call_id,
                     "name": name}
        index, item_id = len(self.output), self.open["id"]
        if kind == "function_call":
            added = function_call_item(item_id, call_id, name, "", status="in_progress")
        elif kind == "message":
            added = message_item(item_id, "", status="in_progress")
        else:
            added = {**reasoning_item(item_id, ""), "content": [], "status": "in_progress"}
        out.append(self.emit("response.output_item.added", output_index=index, item=added))
        part = _output_text("") if kind == "message" else {"type": "reasoning_text", "text": ""}
        if kind != "function_call":
            out.append(self.emit("response.content_part.added", item_id=item_id, output_index=index,
                                 content_index=0, part=part))
        return out

    def _text_delta(self, event_type: str, text: str, **extra: Any) -> str:
        self.open["text"] += text
        return self.emit(event_type, item_id=self.open["id"], output_index=len(self.output), content_index=0,
                         delta=text, **extra)

    def close(self) -> str:
        if self.open is None:
            return ""
        item, self.open = self.open, None
        index, item_id, text = len(self.output), item["id"], item["text"]
        if item["type"] == "function_call":
            done = function_call_item(item_id, item["call_id"], item["name"], item["arguments"])
            out = [self.emit("response.function_call_arguments.done", item_id=item_id, output_index=index,
                             name=item["name"], arguments=item["arguments"])]
        else:
            message = item["type"] == "message"
            done = message_item(item_id, text) if message else reasoning_item(item_id, text)
            part = done["content"][0]
            out = [self.emit("response.output_text.done" if message else "response.reasoning_text.done",
                             item_id=item_id, output_index=index, content_index=0, text=text,
                             **({"logprobs": []} if message else {})),
                   self.emit("response.content_part.done", item_id=item_id, output_index=index,
                             content_index=0, part=part)]
        self.output.append(done)
        out.append(self.emit("response.output_item.done", output_index=index, item=done))
        return "".join(out)
