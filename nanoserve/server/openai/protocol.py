"""OpenAI's completions and chat completions protocol: request models and response bodies.

Owns: the pydantic request models (types checked strictly from JSON, so `"n": "2"` is a 400
rather than a guess), `REFUSED`, the one table of fields a client may send that this server
does not honour, and `refused_field`, the one rule over both: every field of a body is either
declared on its model (honoured) or named in a 400 (a field in `REFUSED` with the sentence
there, any other field as unknown); nothing is silently dropped. Also the small functions that
build response, chunk and usage bodies as plain dicts (the streaming hot path does not pay
for a pydantic model per token).
Refuses: range checks of sampling values; `SamplingParams` is the one place those live.
"""

from __future__ import annotations

import codecs
import difflib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from nanoserve.engine.output import TokenLogprob
    from nanoserve.tokenizer import Tokenizer

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Kind = Literal["completion", "chat"]  # which endpoint: picks the request model and response shapes
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


class OpenAIModel(BaseModel):
    # Extra keys are kept, not dropped, so that `refused_field` can name each one: a body
    # with a field nobody declared is a 400, never a request that quietly does something else.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False,
                              json_schema_extra={"additionalProperties": False})


# -- the fields this server does not honour: refused by name ------------------------------------

def _absent(value: Any, _: BaseModel) -> bool:
    return value is None


def absent_or(*harmless: Any) -> Callable[[Any, BaseModel], bool]:
    """Null, or one of the values that ask for nothing this server does not do."""
    def check(value: Any, _: BaseModel) -> bool:
        return value is None or any(value == h and type(value) is type(h) for h in harmless)
    return check


def empty_or_absent(value: Any, _: BaseModel) -> bool:
    return value is None or value == [] or value == {}


def _best_of_is_n(value: Any, body: BaseModel) -> bool:
    return value is None or value == getattr(body, "n", 1)


def _off_or_not_chat(value: Any, body: BaseModel) -> bool:
    """Completions implement echo; chat's echo (vLLM's: prefix the last message) is another thing."""
    return value is None or value is False or "messages" not in type(body).model_fields


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a field is refused, and which of its values ask for nothing (accepted as if absent)."""

    why: str
    harmless: Callable[[Any, BaseModel], bool] = _absent


_NOT_YET = "is not supported yet"
_STRUCTURED = "llguidance is the one backend; send structured_outputs, response_format or guided_*"
_TEXT_ONLY = "only text content parts are supported"

# Field -> why it is refused. A key names a body field, or a nested one by its path
# ("messages[].tool_calls"). A field listed here is refused whether or not its model declares
# it, unless its value is harmless; to implement one, declare it on the model and delete its
# line here (tests/test_protocol_fields.py checks every known OpenAI and vLLM field is one or
# the other).
REFUSED: dict[str, Refusal] = {
    # OpenAI's
    "suffix": Refusal("suffix (insertion) is not supported", absent_or("")),
    "best_of": Refusal("best_of is not supported (only best_of equal to n)", _best_of_is_n),
    "functions": Refusal("the deprecated functions field is not supported: send tools", empty_or_absent),
    "function_call": Refusal("the deprecated function_call is not supported: send tool_choice",
                             absent_or("none", "auto")),
    "audio": Refusal("audio output is not supported"),
    "modalities": Refusal("only the text modality is supported", absent_or(["text"])),
    "prediction": Refusal("predicted outputs are not supported"),
    "reasoning_effort": Refusal("reasoning_effort is not supported; chat_template_kwargs passes "
                                "switches to templates that read them"),
    "verbosity": Refusal("verbosity is not supported"),
    "web_search_options": Refusal("web search is not supported"),
    "store": Refusal("stored completions are not supported", absent_or(False)),
    "metadata": Refusal("metadata belongs to stored completions, which are not supported", empty_or_absent),
    "service_tier": Refusal("service tiers are not supported", absent_or("auto", "default")),
    "moderation": Refusal("moderation is not supported"),
    "prompt_cache_key": Refusal("prompt_cache_key is not supported: the prefix cache needs no "
                                "hint, and cache_salt keeps users' caches apart"),
    "prompt_cache_retention": Refusal("prompt_cache_retention is not supported: cached blocks "
                                      "stay until the pool needs their room"),
    "prompt_cache_options": Refusal("prompt_cache_options are not supported"),
    # vLLM's
    "structural_tag": Refusal("structural_tag is not supported: " + _STRUCTURED),
    "guided_decoding_backend": Refusal("guided_decoding_backend is not supported: " + _STRUCTURED,
                                       absent_or("auto", "guidance")),
    "guided_whitespace_pattern": Refusal("guided_whitespace_pattern is not supported: JSON is "
                                         "generated with fixed separators and no free whitespace"),
    "use_beam_search": Refusal("beam search is not supported", absent_or(False)),
    "length_penalty": Refusal("length_penalty only applies to beam search, which is not supported",
                              absent_or(1, 1.0)),
    "request_id": Refusal("request_id is not supported: responses carry the server's own id"),
    "logits_processors": Refusal("custom logits processors are not supported", empty_or_absent),
    "return_tokens_as_token_ids": Refusal("return_tokens_as_token_ids is not supported",
                                          absent_or(False)),
    "return_token_ids": Refusal("return_token_ids is not supported", absent_or(False)),
    "prompt_embeds": Refusal("prompt embeddings are not supported"),
    "mm_processor_kwargs": Refusal("multimodal inputs are not supported", empty_or_absent),
    "kv_transfer_params": Refusal("disaggregated serving (kv_transfer_params) is not supported"),
    "vllm_xargs": Refusal("vllm_xargs (custom extensions) are not supported", empty_or_absent),
    "echo": Refusal("echo on chat completions (the new message prefixed with the last one) is "
                    "not supported", _off_or_not_chat),
    "return_token_strs": Refusal("return_token_strs is not supported", absent_or(False)),
    "stream_options.include_obfuscation": Refusal("stream obfuscation is not supported",
                                                  absent_or(False)),
    # nested fields
    "messages[].function_call": Refusal("function calling is not supported"),
    "messages[].audio": Refusal("audio is not supported"),
    "messages[].refusal": Refusal("refusal messages in the history are not supported"),
    "messages[].content[].input_audio": Refusal(_TEXT_ONLY),
    "messages[].content[].file": Refusal(_TEXT_ONLY),
    "messages[].content[].video_url": Refusal(_TEXT_ONLY),
    "messages[].content[].audio_url": Refusal(_TEXT_ONLY),
}


@dataclass(frozen=True, slots=True)
class FieldRefusal:
    param: str  # where the field is, as the client sent it: "messages[1].tool_calls"
    message: str
    code: str  # "unsupported" (a known field) or "unknown_field"


def refused_field(body: BaseModel) -> FieldRefusal | None:
    """The first field of `body` (nested ones too) that this server does not honour. The
    refusals are `REFUSED`, or the body model's own `refused_fields` table (another protocol's)."""
    table = refusals_of(type(body))
    for key, param, value, model in _sent_fields(body, "", ""):
        name = key.rsplit(".", 1)[-1]
        refusal = table.get(key)
        if refusal is not None and not refusal.harmless(value, body):
            return FieldRefusal(param, f"{param}: {refusal.why}", "unsupported")
        if refusal is None and name not in type(model).model_fields:
            return FieldRefusal(param, _unknown(param, key, model, table), "unknown_field")
    return None


def refusals_of(model: type[BaseModel]) -> dict[str, Refusal]:
    return getattr(model, "refused_fields", REFUSED)


def _sent_fields(model: BaseModel, key: str, param: str) -> Iterator[tuple[str, str, Any, BaseModel]]:
    """(table key, client path, value, owning model) of every field the client sent, depth first."""
    sent = [*model.model_fields_set, *(model.model_extra or {})]
    for name in sent:
        value = getattr(model, name) if name in type(model).model_fields else model.model_extra[name]
        shown = name or '""'  # a JSON key may be empty; the error still names it
        field_key, field_param = f"{key}.{name}" if key else name, f"{param}.{shown}" if param else shown
        yield field_key, field_param, value, model
        if isinstance(value, BaseModel):
            yield from _sent_fields(value, field_key, field_param)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _sent_fields(item, f"{field_key}[]", f"{field_param}[{i}]")


def _unknown(param: str, key: str, model: BaseModel, table: dict[str, Refusal]) -> str:
    name = key.rsplit(".", 1)[-1]
    prefix = key[: -len(name)]
    known = [*type(model).model_fields,
             *(k[len(prefix):] for k in table if k.startswith(prefix) and "." not in k[len(prefix):])]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{param}: unknown field{hint} (fields this server does not know are refused, not ignored)"


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description="Usage so far on every chunk (vLLM's).")


class SamplingFields(OpenAIModel):
    """Fields both endpoints share: OpenAI's, then vLLM's extensions, then nanoserve's."""

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
    user: str | None = Field(default=None, description="The end user's id; changes nothing generated.")
    safety_identifier: str | None = Field(default=None, description="As user.")
    top_k: int | None = Field(default=None, description="0 or -1: no limit (as vLLM).")
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    typical_p: float | None = None
    top_n_sigma: float | None = None
    cache_salt: str | None = Field(default=None, description=(
        "Requests share cached prompt blocks only with requests of the same salt (vLLM's)."))
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(default=True, description=(
        "With skip_special_tokens false: a space between each shown special token and its "
        "neighbours (as transformers' and vLLM's slow detokenizers); false joins them."))
    prompt_logprobs: int | None = Field(default=None, ge=0, description=(
        "vLLM's: per prompt position, the prompt token's logprob and rank and the top N "
        "alternatives (the first position null). Not with stream; takes no prefix-cache hits."))
    bad_words: list[str] | None = Field(default=None, description=(
        "Words never generated: each word's last token is banned where the output ends with the rest."))
    allowed_token_ids: list[TokenId] | None = Field(default=None, description="Sample only these ids.")
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, description=(
        "Keep only the prompt's last N tokens."))
    add_special_tokens: bool | None = Field(default=None, description=(
        "Add the tokenizer's BOS to the prompt: default true for completions, false for chat "
        "(whose template writes BOS itself)."))
    p_less: bool | None = None
    # llama-server's samplers, with its names (defaults and ranges: SamplingParams).
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    priority: Int64 = Field(default=0, description=(
        "vLLM's: with --scheduling-policy priority, lower values run first and are preempted "
        "last; ignored under fcfs."))
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
    echo: bool = Field(default=False, description="The prompt's text before each choice's text.")


class ImageURL(OpenAIModel):
    url: str  # a data: URL, or http(s) from a host in serve --allowed-media-domains
    detail: str | None = None


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


Role = Literal["system", "user", "assistant", "tool", "developer"]  # OpenAI's; others are refused


class ChatMessage(OpenAIModel):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier thinking, for templates that show it


class ChatTemplateFlags(OpenAIModel):
    """vLLM's chat-template fields: open a new assistant turn (the default) or continue the last
    message as it stands; a template of the request's own (only where the server trusts them);
    extra variables for the template (`chat_template_kwargs`, RAG `documents`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None

    def template_flags(self) -> dict[str, Any]:
        extra = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            extra["documents"] = self.documents
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "chat_template": self.chat_template, "template_kwargs": extra}


class ChatCompletionRequest(SamplingFields, ChatTemplateFlags):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = Field(default=True, description=(
        "vLLM's: with a reasoning parser the thinking comes back as reasoning_content; false: left out."))
    thinking_token_budget: int | None = Field(default=None, ge=0, description=(
        "Most tokens the thinking may take: then the end tag is forced and the answer follows "
        "(default: serve --reasoning-budget). Needs a reasoning parser."))

    def chat_messages(self, image_placeholder: str | None = None, *,
                      content_parts: bool = False) -> list[dict[str, Any]]:
        """Messages as the chat template wants them: role, text content, and the tool calls and
        tool_call_id of a tool-calling turn. An image part becomes `image_placeholder` in the
        text (None: the model takes no images, and an image part is refused naming it); with
        `content_parts` (a template that reads parts, as SmolVLM's) the content is a list of
        {"type": "text", "text"} and {"type": "image"} parts instead."""
        return [_template_message(m, i, image_placeholder, content_parts)
                for i, m in enumerate(self.messages)]

    def image_parts(self) -> list[tuple[str, str]]:
        """(where it is, its URL) of each image part, in prompt order."""
        return [(f"messages[{i}].content[{j}].image_url", part.image_url.url)
                for i, message in enumerate(self.messages) if isinstance(message.content, list)
                for j, part in enumerate(message.content) if part.type == "image_url" and part.image_url]


RequestBody = CompletionRequest | ChatCompletionRequest  # a validated body of either endpoint


class TokenizeRequest(ChatTemplateFlags):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # as generation does: true for a prompt, false for messages

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


def _template_message(message: ChatMessage, index: int, image_placeholder: str | None,
                      content_parts: bool) -> dict[str, Any]:
    content: str | list[dict[str, str]] = _text_of(message, index, image_placeholder)
    if content_parts:
        content = _parts_of(message, index, image_placeholder)
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        rendered["tool_calls"] = [_template_tool_call(call, f"messages[{index}].tool_calls[{j}]")
                                  for j, call in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        rendered["reasoning_content"] = message.reasoning_content
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


def _text_of(message: ChatMessage, index: int, image_placeholder: str | None = None) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", image_placeholder)
                   for part in _parts_of(message, index, image_placeholder))


def _parts_of(message: ChatMessage, index: int, image_placeholder: str | None) -> list[dict[str, str]]:
    """The content as text and image parts, each checked."""
    content = message.content
    if content is None or isinstance(content, str):
        return [{"type": "text", "text": content or ""}]
    parts = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if part.type == "image_url":
            if image_placeholder is None:
                raise UnsupportedContentError("this model takes no images (it has no vision tower); "
                                              "content parts of type 'image_url' need a vision-language "
                                              "model", param=where)
            if part.image_url is None:
                raise UnsupportedContentError("a content part of type 'image_url' needs its image_url",
                                              param=f"{where}.image_url")
            if part.image_url.detail not in (None, "auto"):
                raise UnsupportedContentError("image detail levels are not supported: an image is processed "
                                              "as its model's processor does",
                                              param=f"{where}.image_url.detail")
            parts.append({"type": "image"})
            continue
        if part.type != "text":
            raise UnsupportedContentError(
                f"content parts of type {part.type!r} are not supported (text and image_url only)",
                param=where)
        if part.text is None:
            raise UnsupportedContentError("a content part of type 'text' needs its text",
                                          param=f"{where}.text")
        parts.append({"type": "text", "text": part.text})
    return parts


# -- response bodies ----------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def envelope(kind: Kind, request_id: str, model: str, created: int, *, chunk: bool) -> dict[str, Any]:
    objects = {("completion", False): "text_completion", ("completion", True): "text_completion",
               ("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}
    return {"id": request_id, "object": objects[kind, chunk], "created": created, "model": model}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: str | int | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
                stop_reason: str | int | None, tool_calls: list[dict] | None = None,
                reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message.update(reasoning_content=reasoning, reasoning=reasoning)  # vLLM's older and newer names
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
         "root": names[0], "parent": None, "max_model_len": max_model_len} for name in names]}


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


def echo_logprobs(prompt_ids: Sequence[int], entries: Sequence[TokenLogprob | None], names: TokenText,
                  offset: TextOffset, num_top: int) -> dict:
    """The prompt's tokens in the legacy completions format (echo with logprobs): the first
    has no logprob and no alternatives (null), as OpenAI and vLLM report it."""
    first = prompt_ids[0]
    head = {"tokens": [names.name(first)], "token_logprobs": [None], "top_logprobs": [None],
            "text_offset": [offset.advance(names.text_bytes(first))]}
    rest = completion_logprobs([entry.narrowed(num_top) for entry in entries[1:]], names, offset)
    return {key: head[key] + rest[key] for key in head}


def prompt_logprobs_body(entries: Sequence[TokenLogprob | None], num_top: int, names: TokenText) -> list:
    """vLLM's prompt_logprobs: per prompt position a map of token id (a string key, as JSON has
    it) to its logprob, rank and text, the prompt's own token first, then the top `num_top`;
    null for the first position and for an image's rows where their id lies outside the
    vocabulary (no token there to score)."""
    def record(logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
        return {"logprob": clamp_logprob(logprob), "rank": rank, "decoded_token": names.text(token_id)}

    body: list[dict | None] = [None]
    for entry in entries[1:]:
        if entry is None:
            body.append(None)
            continue
        ranked = {str(entry.token_id): record(entry.logprob, entry.rank, entry.token_id)}
        for rank, (token_id, logprob) in enumerate(entry.top[:num_top], start=1):
            ranked.setdefault(str(token_id), record(logprob, rank, token_id))
        body.append(ranked)
    return body
