"""Every field a client may send is honoured or refused by name: the schemas walked.

The known fields are OpenAI's (written out here, and read from the installed `openai` client
when there is one), vLLM's (written out from vllm/entrypoints/openai/protocol.py) and, for
/v1/messages, Anthropic's (read from the installed `anthropic` client). Each
must be declared on our request model (honoured) or listed in `protocol.REFUSED`; each refused
field, sent with a value that asks for something, is a 400 naming it; vLLM's defaults and
OpenAI's harmless values are accepted; a field nobody knows is refused as unknown.
"""

from __future__ import annotations

import typing

import pytest

from nanoserve.server.anthropic import messages
from nanoserve.server.anthropic.messages import MESSAGES_REFUSED, MessagesRequest
from nanoserve.server.openai import protocol
from nanoserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest, refused_field

OPENAI_COMPLETIONS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
    "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user",
}
OPENAI_CHAT = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
    "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n",
    "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
}
OPENAI_MESSAGE = {"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "audio",
                  "refusal"}
OPENAI_STREAM_OPTIONS = {"include_usage", "include_obfuscation"}
VLLM_SAMPLING = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
    "bad_words",
}
VLLM_EXTRA = {"priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
              "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs", "structured_outputs",
              "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
              "guided_whitespace_pattern", "structural_tag", "response_format"}
VLLM_COMPLETIONS = VLLM_SAMPLING | VLLM_EXTRA | {"prompt_embeds", "add_special_tokens", "echo", "suffix"}
VLLM_CHAT = VLLM_SAMPLING | VLLM_EXTRA | {
    "best_of", "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "include_reasoning",
    "reasoning_effort", "parallel_tool_calls", "tools", "tool_choice"}
VLLM_MESSAGE = {"reasoning_content"}
VLLM_STREAM_OPTIONS = {"continuous_usage_stats"}

# A value of each refused field that asks for something this server does not do.
PROBES: dict[str, object] = {
    "suffix": "y", "best_of": 3, "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required", "parallel_tool_calls": "yes", "functions": [{"name": "f"}],
    "function_call": {"name": "f"}, "response_format": {"type": "json_object"},
    "audio": {"voice": "alloy"}, "modalities": ["text", "audio"], "prediction": {"type": "content"},
    "reasoning_effort": "high", "verbosity": "low", "web_search_options": {}, "store": True,
    "metadata": {"a": "b"}, "service_tier": "flex", "moderation": {}, "prompt_cache_key": "k",
    "prompt_cache_retention": "24h", "prompt_cache_options": {}, "structured_outputs": {"json": {}},
    "guided_json": {}, "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "root ::= \"a\"",
    "structural_tag": "{}", "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    "p_less": 0.5, "use_beam_search": True,
    "length_penalty": 0.5, "request_id": "r", "logits_processors": ["m.P"],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "prompt_embeds": "AAAA",
    "mm_processor_kwargs": {"a": 1}, "kv_transfer_params": {}, "vllm_xargs": {"a": 1},
    "echo": True, "return_token_strs": True,
    "include_stop_str_in_output": True, "skip_special_tokens": False, "truncate_prompt_tokens": 4,
    "bad_words": ["x"], "allowed_token_ids": [1], "chat_template": "{{ 1 }}",
    "chat_template_kwargs": {"a": 1}, "documents": [{"title": "t"}], "add_special_tokens": True,
    "stream_options.include_obfuscation": True, "stream_options.continuous_usage_stats": True,
    "messages[].role": "tool", "messages[].tool_calls": [{"id": "c"}], "messages[].tool_call_id": "c",
    "messages[].function_call": {"name": "f"}, "messages[].audio": {"id": "a"}, "messages[].refusal": "no",
    "messages[].content[].input_audio": {}, "messages[].content[].file": {},
    "messages[].content[].video_url": {}, "messages[].content[].audio_url": {},
}
# vLLM's defaults, as a vLLM client may send them: asking for nothing, they are accepted.
VLLM_DEFAULTS = {"use_beam_search": False, "length_penalty": 1.0, "include_stop_str_in_output": False,
                 "skip_special_tokens": True, "spaces_between_special_tokens": True, "priority": 0,
                 "bad_words": [], "include_reasoning": True, "echo": False, "add_generation_prompt": True,
                 "continue_final_message": False, "tool_choice": "none", "parallel_tool_calls": False}
MESSAGES = [{"role": "user", "content": "hi"}]


def _openai_client_fields(module_name: str) -> set[str]:
    """The request fields of the installed openai client, if any (its TypedDicts say them)."""
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    module = {"completions": openai.types.completion_create_params,
              "chat": openai.types.chat.completion_create_params}[module_name]
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


def _covered(model: type, field: str, prefix: str = "") -> bool:
    return field in model.model_fields or f"{prefix}{field}" in protocol.REFUSED


@pytest.mark.parametrize(("model", "known"), [
    (CompletionRequest, OPENAI_COMPLETIONS | VLLM_COMPLETIONS),
    (ChatCompletionRequest, OPENAI_CHAT | VLLM_CHAT),
], ids=["completions", "chat"])
def test_every_known_request_field_is_honoured_or_refused(model: type, known: set[str]) -> None:
    assert sorted(f for f in known if not _covered(model, f)) == []


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_field_of_the_installed_openai_client_is_honoured_or_refused(endpoint: str) -> None:
    model = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
    assert sorted(f for f in _openai_client_fields(endpoint) if not _covered(model, f)) == []


def test_every_known_nested_field_is_honoured_or_refused() -> None:
    assert sorted(f for f in OPENAI_MESSAGE | VLLM_MESSAGE
                  if not _covered(protocol.ChatMessage, f, "messages[].")) == []
    assert sorted(f for f in OPENAI_STREAM_OPTIONS | VLLM_STREAM_OPTIONS
                  if not _covered(protocol.StreamOptions, f, "stream_options.")) == []


def _body_with(key: str, value: object) -> dict:
    """A chat body (or a completions one, for completions-only fields) carrying `key` = value."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    if key.startswith("messages[].content[]."):
        body["messages"][0]["content"] = [{"type": "text", "text": "hi", key.rsplit(".", 1)[1]: value}]
    elif key.startswith("messages[]."):
        body["messages"][0][key.split(".", 1)[1]] = value
    elif key.startswith("stream_options."):
        body.update(stream=True, stream_options={key.split(".", 1)[1]: value})
    else:
        body[key] = value
    return body


def _param_of(key: str) -> str:
    return key.replace("messages[].content[]", "messages[0].content[0]").replace("messages[]", "messages[0]")


@pytest.mark.parametrize("key", sorted(protocol.REFUSED))
def test_each_refused_field_asking_for_something_is_refused_by_name(key: str) -> None:
    assert key in PROBES, f"add a probe value for the refused field {key!r}"
    body = ChatCompletionRequest.model_validate(_body_with(key, PROBES[key]))
    refusal = refused_field(body)
    assert refusal is not None and refusal.param == _param_of(key) and refusal.code == "unsupported"
    assert protocol.REFUSED[key].why in refusal.message


def test_vllm_defaults_and_openai_harmless_values_are_accepted() -> None:
    body = {"messages": MESSAGES, **VLLM_DEFAULTS, "tools": [], "response_format": {"type": "text"},
            "store": False, "service_tier": "auto", "modalities": ["text"], "user": "u"}
    assert refused_field(ChatCompletionRequest.model_validate(body)) is None
    completion = {"prompt": "x", "best_of": 1, "n": 1, "echo": False, "suffix": None}
    assert refused_field(CompletionRequest.model_validate(completion)) is None


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "temprature": 1}, "temprature"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "usage": 1}},
     "stream_options.usage"),
])
def test_an_unknown_field_is_refused_as_unknown(body: dict, param: str) -> None:
    refusal = refused_field(CompletionRequest.model_validate(body))
    assert refusal is not None and refusal.param == param and refusal.code == "unknown_field"


def test_a_misspelled_field_is_answered_with_the_likely_one() -> None:
    refusal = refused_field(CompletionRequest.model_validate({"prompt": "x", "max_token": 3}))
    assert refusal is not None and "'max_tokens'" in refusal.message


# -- Anthropic's Messages API (/v1/messages) -------------------------------------------------------

# Sent by llama.cpp's and vLLM's clients and by older anthropic clients; newer ones pass them in
# extra_body.
ANTHROPIC_SAMPLING = {"temperature", "top_k", "top_p", "stream"}
ANTHROPIC_PROBES: dict[str, object] = {
    "container": "c1", "mcp_servers": [{"type": "url", "url": "x"}], "context_management": {},
    "diagnostics": {"previous_message_id": "m"}, "inference_geo": "us", "speed": "fast",
    "user_profile_id": "u", "workspace_id": "w", "service_tier": "priority", "output_config.effort": "high",
    "messages[].content[].citations": [{"type": "char_location"}], "messages[].content[].caller": {},
    "messages[].content[].toolset_name": "t", "messages[].content[].transformations": {},
    "system[].citations": [{"type": "char_location"}], "tools[].allowed_callers": ["code"],
    "tools[].defer_loading": True, "tools[].input_examples": [{}], "tools[].strict": True,
    "tools[].eager_input_streaming": True,
}


def _anthropic_fields(*names: str) -> set[str]:
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
    from anthropic.types import message_create_params

    fields: set[str] = set()
    for name in names:
        holder = getattr(message_create_params, name, None) or getattr(anthropic.types, name)
        fields |= set(typing.get_type_hints(holder))
    return fields


@pytest.mark.parametrize(("model", "prefix", "names", "extra"), [
    ("MessagesRequest", "", ("MessageCreateParamsBase",), ANTHROPIC_SAMPLING),
    ("ContentBlock", "messages[].content[].", ("TextBlockParam", "ToolUseBlockParam", "ToolResultBlockParam",
                                               "ImageBlockParam", "ThinkingBlockParam"), set()),
    ("AnthropicTool", "tools[].", ("ToolParam",), set()),
    ("ToolChoice", "tool_choice.", ("ToolChoiceAutoParam", "ToolChoiceAnyParam", "ToolChoiceToolParam",
                                    "ToolChoiceNoneParam"), set()),
    ("OutputConfig", "output_config.", ("OutputConfigParam",), set()),
    ("Thinking", "thinking.", ("ThinkingConfigEnabledParam", "ThinkingConfigDisabledParam"), set()),
])
def test_every_field_of_the_anthropic_client_is_honoured_or_refused(model, prefix, names, extra) -> None:
    declared = getattr(messages, model).model_fields
    missing = [f for f in _anthropic_fields(*names) | extra
               if f not in declared and f"{prefix}{f}" not in MESSAGES_REFUSED]
    assert sorted(missing) == []


def _messages_body_with(key: str, value: object) -> dict:
    body: dict = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    name = key.rsplit(".", 1)[-1]
    if key.startswith("messages[].content[]."):
        body["messages"][0]["content"] = [{"type": "text", "text": "hi", name: value}]
    elif key.startswith("system[]."):
        body["system"] = [{"type": "text", "text": "s", name: value}]
    elif key.startswith("tools[]."):
        body["tools"] = [{"name": "f", "input_schema": {"type": "object"}, name: value}]
    elif key.startswith("output_config."):
        body["output_config"] = {name: value}
    else:
        body[key] = value
    return body


@pytest.mark.parametrize("key", sorted(MESSAGES_REFUSED))
def test_each_refused_messages_field_asking_for_something_is_refused_by_name(key: str) -> None:
    assert key in ANTHROPIC_PROBES, f"add a probe value for the refused field {key!r}"
    refusal = refused_field(MessagesRequest.model_validate(_messages_body_with(key, ANTHROPIC_PROBES[key])))
    expected = key.replace("[]", "[0]")
    assert refusal is not None and refusal.param == expected and refusal.code == "unsupported"
    assert MESSAGES_REFUSED[key].why in refusal.message


# -- OpenAI's Responses API (/v1/responses) ---------------------------------------------------------

RESPONSES_PROBES: dict[str, object] = {
    "store": True, "previous_response_id": "resp_1", "conversation": "conv_1", "background": True,
    "background_options": {}, "include": ["reasoning.encrypted_content"], "metadata": {"a": "b"},
    "max_tool_calls": 2, "prompt": {"id": "p"}, "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {}, "service_tier": "flex", "truncation": "auto", "top_logprobs": 2,
    "moderation": {}, "image": {}, "access_programs": [], "context_management": [{}],
    "stream_options.include_obfuscation": True, "reasoning.effort": "high", "reasoning.summary": "auto",
    "reasoning.generate_summary": "auto", "reasoning.context": "all_turns", "reasoning.mode": "pro",
    "text.verbosity": "low", "input[].phase": "final",
    "input[].caller": {}, "input[].namespace": "n", "input[].async": True, "input[].encrypted_content": "e",
    "input[].content[].file_id": "f", "input[].content[].file_data": "d",
    "input[].content[].file_url": "u", "input[].content[].filename": "f.txt",
    "input[].content[].detail": "high",
    "input[].content[].prompt_cache_breakpoint": {}, "input[].content[].annotations": [{"type": "x"}],
    "input[].content[].logprobs": [{"token": "a"}], "tools[].allowed_callers": ["code"],
    "tools[].async": True, "tools[].defer_loading": True, "tools[].output_schema": {},
    "tools[].strict": True,
}


def _openai_responses_fields(*names: str) -> set[str]:
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    from openai.types import shared_params
    from openai.types.responses import response_create_params, response_input_item_param

    fields: set[str] = set()
    for name in names:
        holder = next(getattr(module, name) for module in (
            response_create_params, response_input_item_param, openai.types.responses, shared_params)
            if hasattr(module, name))
        fields |= set(typing.get_type_hints(holder))
    return fields


@pytest.mark.parametrize(("model", "prefix", "names", "extra"), [
    ("ResponsesRequest", "", ("ResponseCreateParamsBase",), {"stream"}),
    ("InputItem", "input[].", ("EasyInputMessageParam", "Message", "ResponseFunctionToolCallParam",
                               "FunctionCallOutput", "ResponseReasoningItemParam"), set()),
    ("ContentPart", "input[].content[].", ("ResponseInputTextParam", "ResponseOutputTextParam",
                                           "ResponseInputImageParam", "ResponseInputFileParam"), set()),
    ("FunctionTool", "tools[].", ("FunctionToolParam",), set()),
    ("TextConfig", "text.", ("ResponseTextConfigParam",), set()),
    ("TextFormat", "text.format.", ("ResponseFormatTextJSONSchemaConfigParam",), set()),
    ("ReasoningOptions", "reasoning.", ("Reasoning",), set()),
    ("StreamOptions", "stream_options.", ("StreamOptions",), set()),
])
def test_every_field_of_the_openai_responses_client_is_honoured_or_refused(model, prefix, names,
                                                                          extra) -> None:
    from nanoserve.server.openai import responses

    model_type = getattr(responses, model)
    declared = {field.alias or name for name, field in model_type.model_fields.items()}
    missing = [f for f in _openai_responses_fields(*names) | extra
               if f not in declared and f"{prefix}{f}" not in responses.RESPONSES_REFUSED]
    assert sorted(missing) == []


def _responses_body_with(key: str, value: object) -> dict:
    body: dict = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    name = key.rsplit(".", 1)[-1]
    if key.startswith("input[].content[]."):
        body["input"][0]["content"][0][name] = value
    elif key.startswith("input[]."):
        body["input"][0][name] = value
    elif key.startswith("tools[]."):
        body["tools"] = [{"type": "function", "name": "f", name: value}]
    elif "." in key:
        head = key.split(".", 1)[0]
        body[head] = {name: value}
    else:
        body[key] = value
    return body


def test_each_refused_responses_field_asking_for_something_is_refused_by_name() -> None:
    from nanoserve.server.openai.responses import RESPONSES_REFUSED, ResponsesRequest

    for key, refusal in RESPONSES_REFUSED.items():
        assert key in RESPONSES_PROBES, f"add a probe value for the refused field {key!r}"
        body = ResponsesRequest.model_validate(_responses_body_with(key, RESPONSES_PROBES[key]))
        found = refused_field(body)
        assert found is not None and found.param == key.replace("[]", "[0]"), key
        assert found.code == "unsupported", key
        assert refusal.why in found.message


# -- OpenAI's embeddings (/v1/embeddings) -----------------------------------------------------------

VLLM_EMBEDDINGS = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
                   "add_special_tokens", "priority", "request_id", "normalize", "embed_dtype", "endianness",
                   "messages", "mm_processor_kwargs", "additional_data", "use_activation", "cache_salt"}
EMBEDDINGS_PROBES: dict[str, object] = {
    "request_id": "r", "embed_dtype": "float16", "endianness": "big", "messages": [{"role": "user"}],
    "mm_processor_kwargs": {"a": 1}, "additional_data": {"a": 1}, "use_activation": True,
}


def test_every_embeddings_field_of_the_openai_client_and_vllm_is_honoured_or_refused() -> None:
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    from nanoserve.server.openai.embeddings import EMBEDDINGS_REFUSED, EmbeddingRequest

    client_fields = set(typing.get_type_hints(openai.types.embedding_create_params.EmbeddingCreateParams))
    missing = [f for f in client_fields | VLLM_EMBEDDINGS
               if f not in EmbeddingRequest.model_fields and f not in EMBEDDINGS_REFUSED]
    assert sorted(missing) == []


def test_each_refused_embeddings_field_asking_for_something_is_refused_by_name() -> None:
    from nanoserve.server.openai.embeddings import EMBEDDINGS_REFUSED, EmbeddingRequest

    for key, refusal in EMBEDDINGS_REFUSED.items():
        assert key in EMBEDDINGS_PROBES, f"add a probe value for the refused field {key!r}"
        found = refused_field(EmbeddingRequest.model_validate({"input": "x", key: EMBEDDINGS_PROBES[key]}))
        assert found is not None and found.param == key and found.code == "unsupported", key
        assert refusal.why in found.message
    harmless = {"input": "x", "embed_dtype": "float32", "endianness": "native", "mm_processor_kwargs": {}}
    assert refused_field(EmbeddingRequest.model_validate(harmless)) is None
