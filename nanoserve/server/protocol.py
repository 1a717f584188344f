"""OpenAI's completions and chat completions protocol: request models and response bodies.

Owns: the pydantic request models (unknown fields tolerated, types checked strictly from
JSON, so `"n": "2"` is a 400 rather than a guess), the list of accepted-but-unsupported
fields that would change output (refused by name, never silently ignored), and the small
functions that build response, chunk and usage bodies as plain dicts (the streaming hot path
does not pay for a pydantic model per token).
Refuses: range checks of sampling values; `SamplingParams` is the one place those live.
"""

from __future__ import annotations

import codecs
import json
import math
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from nanoserve.output import TokenLogprob
    from nanoserve.tokenizer import Tokenizer

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Kind = Literal["completion", "chat"]  # which endpoint: picks the request model and response shapes


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields both endpoints share: OpenAI's, then vLLM's extensions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, description=(
        "Generation stops at the first stop string to be completed; the returned text excludes "
        "it. If two complete at the same character, the longer one is reported (stop_reason). "
        "A stop string counts only if a token after the first min_tokens completes it."))
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    top_n_sigma: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    p_less: bool | None = None
    # Structured outputs (server/structured_fields.py turns them into one spec).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to a value this server cannot honour."""
        if self.echo:
            return "echo", "echo is not supported: the response never repeats the prompt"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (only best_of equal to n)"
        return None


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


Role = Literal["system", "user", "assistant", "tool", "developer"]  # OpenAI's; others are refused


class ChatMessage(OpenAIModel):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatTemplateFlags(OpenAIModel):
    """vLLM's chat-template switches: open a new assistant turn (the default), or continue the
    last message as it stands."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def template_flags(self) -> dict[str, bool]:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


class ChatCompletionRequest(SamplingFields, ChatTemplateFlags):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions:
            return "functions", "the deprecated functions field is not supported: send tools"
        if self.function_call not in (None, "none", "auto"):
            return "function_call", "the deprecated function_call is not supported: send tool_choice"
        return None

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them: role, text content, and the tool calls and
        tool_call_id of a tool-calling turn."""
        return [_template_message(m, i) for i, m in enumerate(self.messages)]


RequestBody = CompletionRequest | ChatCompletionRequest  # a validated body of either endpoint


class TokenizeRequest(ChatTemplateFlags):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": _text_of(m, i)} for i, m in enumerate(self.messages or [])]


class DetokenizeRequest(OpenAIModel):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


class UnsupportedContentError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": _text_of(message, index)}
    if message.tool_calls:
        rendered["tool_calls"] = [_template_tool_call(call, f"messages[{index}].tool_calls[{j}]")
                                  for j, call in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _template_tool_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier call as templates read it (as transformers and vLLM hand it over): the
    arguments as an object, not OpenAI's JSON string."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise UnsupportedContentError("a tool call needs a function with a name", param=f"{where}.function")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise UnsupportedContentError("tool call arguments must be a JSON object (as a string)",
                                          param=f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise UnsupportedContentError("tool call arguments must be a JSON object",
                                      param=f"{where}.function.arguments")
    return {**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _text_of(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise UnsupportedContentError(
                f"content parts of type {part.type!r} are not supported (text only)",
                param=f"messages[{index}].content[{j}]")
        if part.text is None:
            raise UnsupportedContentError("a content part of type 'text' needs its text",
                                          param=f"messages[{index}].content[{j}].text")
        texts.append(part.text)
    return "".join(texts)


# -- response bodies ----------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def envelope(kind: Kind, request_id: str, model: str, created: int, *, chunk: bool) -> dict[str, Any]:
    objects = {("completion", False): "text_completion", ("completion", True): "text_completion",
               ("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}
    return {"id": request_id, "object": objects[kind, chunk], "created": created, "model": model}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: str | int | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
                stop_reason: str | int | None, tool_calls: list[dict] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message,
            "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_delta_choice(index: int, delta: dict[str, str], logprobs: dict | None,
                      finish_reason: str | None, stop_reason: str | int | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def model_list(names: list[str], max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "nanoserve",
         "root": names[0], "max_model_len": max_model_len} for name in names]}


def now_s() -> int:
    return int(time.time())


# -- logprobs -----------------------------------------------------------------------------------

MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp the same way


class TokenText:
    """Each token id's text, raw bytes and legacy-format name, cached: logprobs name tokens one
    at a time."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)
        self.name = lru_cache(maxsize=1 << 16)(self._name)
        self.text_bytes = lru_cache(maxsize=1 << 16)(self._text_bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token_id))

    def _name(self, token_id: int) -> str:
        """The token's text when its bytes are whole UTF-8 characters, else OpenAI's
        "bytes:\\xe4\\xbd" form: part of a character has no text of its own, and naming every
        such piece "\ufffd" would merge distinct tokens."""
        raw = bytes(self._bytes(token_id))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
        return self.text(token_id)

    def _text_bytes(self, token_id: int) -> bytes:
        """The bytes the token adds to the response text: none for a special token, which the
        detokenizer skips."""
        if self.tokenizer.decode([token_id], skip_special_tokens=True) == "":
            return b""
        return bytes(self._bytes(token_id))


class TextOffset:
    """Where the next token starts in the response text, in characters, counted from the bytes
    emitted so far: a token that ends inside a character adds no characters until a later token
    completes it. Carried across a stream's chunks."""

    def __init__(self, chars: int = 0) -> None:
        self.chars = chars
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """Feed one token's bytes; return the token's own offset (the characters before it)."""
        start = self.chars
        self.chars += len(self._decoder.decode(raw))
        return start


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def completion_logprobs(entries: Sequence[TokenLogprob], names: TokenText,
                        text_offset: int | TextOffset = 0) -> dict:
    """OpenAI's legacy completions format; offsets continue from `text_offset` (a `TextOffset`
    is advanced in place, so a stream's next chunk goes on from where this one ended).

    A token that is not whole UTF-8 characters is named "bytes:\\xNN..." as OpenAI does, so
    distinct tokens keep distinct `top_logprobs` keys; should two ids still share a name, the
    higher logprob stays, and the chosen token's own entry always equals its `token_logprobs`.
    """
    offset = text_offset if isinstance(text_offset, TextOffset) else TextOffset(text_offset)
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        token = names.name(entry.token_id)
        logprob = clamp_logprob(entry.logprob)
        tokens.append(token)
        token_logprobs.append(logprob)
        top: dict[str, float] = {}
        for token_id, alternative in entry.top:
            name, alternative = names.name(token_id), clamp_logprob(alternative)
            if name not in top or alternative > top[name]:
                top[name] = alternative
        top[token] = logprob
        top_logprobs.append(top)
        offsets.append(offset.advance(names.text_bytes(entry.token_id)))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprob], names: TokenText) -> dict:
    """Chat format: one record per token with its bytes and its top alternatives."""
    def record(token_id: int, logprob: float) -> dict:
        return {"token": names.text(token_id), "logprob": clamp_logprob(logprob),
                "bytes": names.bytes(token_id)}

    return {"content": [
        {**record(entry.token_id, entry.logprob),
         "top_logprobs": [record(token_id, logprob) for token_id, logprob in entry.top]}
        for entry in entries]}
