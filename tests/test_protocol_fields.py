"""Every field a client may send is honoured or refused by name: the schemas walked.

The known fields are OpenAI's (written out here, and read from the installed `openai` client
when there is one) and vLLM's (written out from vllm/entrypoints/openai/protocol.py). Each
must be declared on our request model (honoured) or listed in `protocol.REFUSED`; each refused
field, sent with a value that asks for something, is a 400 naming it; vLLM's defaults and
OpenAI's harmless values are accepted; a field nobody knows is refused as unknown.
"""

from __future__ import annotations

import typing

import pytest

from nanoserve.server import protocol
from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest, refused_field

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
    "include_reasoning": False, "echo": True, "return_token_strs": True,
    "include_stop_str_in_output": True, "skip_special_tokens": False, "truncate_prompt_tokens": 4,
    "bad_words": ["x"], "allowed_token_ids": [1], "chat_template": "{{ 1 }}",
    "chat_template_kwargs": {"a": 1}, "documents": [{"title": "t"}], "add_special_tokens": True,
    "stream_options.include_obfuscation": True, "stream_options.continuous_usage_stats": True,
    "messages[].role": "tool", "messages[].tool_calls": [{"id": "c"}], "messages[].tool_call_id": "c",
    "messages[].function_call": {"name": "f"}, "messages[].audio": {"id": "a"}, "messages[].refusal": "no",
    "messages[].reasoning_content": "hm", "messages[].content[].image_url": {"url": "x"},
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
