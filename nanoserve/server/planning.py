"""Request planning: from a validated body to the engine's sequences, or a 4xx naming the field.

Owns: `check_body` (what can be refused without the engine: the model name and the server's
limits; fields the server does not honour were refused as the body was parsed) and `plan`
(tokenize each prompt, fill in max_tokens and per-choice seeds, build the `SamplingParams`
and run every engine check, with the engines' own `InputProcessor`, `state.admission`), so a
request that gets past planning costs the engine nothing it could refuse later.
`refusals_as_400` is the one place an `InvalidRequestError` from the tokenizer,
`SamplingParams` or the engine becomes a 400, naming the field the client sent rather than the
engine's name for it.
Refuses: touching the engine's state (`plan` runs off the event loop and only reads
configuration), range checks of sampling values (`SamplingParams` owns those), and HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.errors import InvalidRequestError
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    SamplingParams,
    StructuredOutputs,
    keep_last_tokens,
)
from nanoserve.server.errors import bad_request
from nanoserve.server.images import load_image
from nanoserve.server.openai import protocol
from nanoserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest, Kind, RequestBody
from nanoserve.server.parsers.reasoning import ReasoningPlan
from nanoserve.server.parsers.structured_fields import structured_outputs
from nanoserve.server.parsers.tool_calls import ToolPlan
from nanoserve.server.parsers.tool_formats import resolve_format
from nanoserve.server.state import ServerLimits, ServerState
from nanoserve.tokenizer import template_reads_parts

if TYPE_CHECKING:
    from nanoserve.engine.admission import InputProcessor
    from nanoserve.multimodal.inputs import ImageInput


@dataclass(frozen=True, slots=True)
class PlannedSequence:
    index: int  # the choice index: prompt_index * n + j
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None = None  # the chat's tools and tool_choice, read back from the reply
    echo: str = ""  # text the choice starts with (completions' echo: the prompt's)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, as the body asked
    echo_logprobs: int | None = None  # completions' echo with logprobs N: the prompt's tokens lead them
    reasoning: ReasoningPlan | None = None  # a chat of a reasoning model: its think block
    pooling: PoolingParams | None = None  # an embedding request (/v1/embeddings): pooled, not sampled
    images: tuple[ImageInput, ...] = ()  # a chat's images, placed in prompt_ids


@dataclass(frozen=True, slots=True)
class PlannedPrompt:
    ids: list[int]
    echo: str = ""
    images: tuple[ImageInput, ...] = ()


# -- the one conversion -------------------------------------------------------------------------

@contextlib.contextmanager
def refusals_as_400(body: RequestBody, *, param: str | None = None) -> Iterator[None]:
    """Raise an `InvalidRequestError` from the block as a 400. `param` overrides the field it
    names, for when the caller knows better (which prompt of a batch was empty)."""
    try:
        yield
    except InvalidRequestError as error:
        raise bad_request(error.message, param or client_param(body, error.param)) from None


def client_param(body: RequestBody, param: str | None) -> str | None:
    """The field the client actually sent for an engine-side name."""
    if isinstance(body, ChatCompletionRequest):
        if param is None or param == "prompt":  # a chat's prompt is its rendered messages
            return "messages"
        if param == "logprobs":
            return "top_logprobs"
        if param == "max_tokens" and body.max_completion_tokens is not None:
            return "max_completion_tokens"
    return param


# -- checks that need no engine -----------------------------------------------------------------

def check_body(state: ServerState, body: RequestBody) -> None:
    """Refuse what the body asks for that this server does not serve or allow: 404 or 400."""
    check_model(state, body.model)
    _check_limits(body, state.limits)
    if isinstance(body, ChatCompletionRequest):
        check_chat_template(body, state.limits)
    elif body.echo and body.logprobs is not None and body.stream:
        raise bad_request("echo with logprobs is not available with stream: true (the prompt's "
                          "logprobs come with the whole response)", "echo", code="unsupported")


def check_chat_template(body: protocol.ChatTemplateFlags, limits: ServerLimits) -> None:
    """A template from a request runs on the server (sandboxed, but as long as it likes): only
    a server started with --trust-request-chat-template takes one, as in vLLM."""
    if body.chat_template is not None and not limits.trust_request_chat_template:
        raise bad_request("this server does not take chat templates from requests (start it with "
                          "--trust-request-chat-template to allow them)", "chat_template",
                          code="unsupported")


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.accepted_names:
        state.adapters.lora_for(model)  # a LoRA adapter's name, or a 404 naming what is served


def _check_limits(body: RequestBody, limits: ServerLimits) -> None:
    if body.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n} on this server; got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    top, name = _top_logprobs(body)
    if top is not None and top > limits.max_top_logprobs:
        raise bad_request(f"{name} must be at most {limits.max_top_logprobs}; got {top}", name)
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if body.prompt_logprobs is not None:
        if body.stream:  # vLLM refuses them with stream too
            raise bad_request("prompt_logprobs are not available with stream: true", "prompt_logprobs",
                              code="unsupported")
        if body.prompt_logprobs > limits.max_top_logprobs:
            raise bad_request(f"prompt_logprobs must be at most {limits.max_top_logprobs}; got "
                              f"{body.prompt_logprobs}", "prompt_logprobs")


def _top_logprobs(body: RequestBody) -> tuple[int | None, str]:
    """How many top logprobs per token the body asks for, and the field that asks."""
    if isinstance(body, CompletionRequest):
        return body.logprobs, "logprobs"
    if not body.logprobs:
        return None, "top_logprobs"
    return body.top_logprobs or 0, "top_logprobs"


# -- /tokenize and /detokenize ------------------------------------------------------------------

def tokenize(state: ServerState, body: protocol.TokenizeRequest) -> list[int]:
    """The prompt's or the chat's token ids, as a generation request would see them. Blocking."""
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages",
                          "prompt" if body.prompt is None else "messages")
    tokenizer = state.admission.tokenizer
    if body.prompt is not None:
        return tokenizer.encode(body.prompt, add_bos=False if body.add_special_tokens is False else None)
    check_chat_template(body, state.limits)
    try:
        messages = body.chat_messages()
    except protocol.UnsupportedContentError as error:
        raise bad_request(str(error), error.param) from None
    try:
        return tokenizer.encode_chat(messages, **body.template_flags(),
                                     add_special_tokens=bool(body.add_special_tokens))
    except InvalidRequestError as error:
        raise bad_request(error.message, error.param or "messages") from None


def detokenize(state: ServerState, body: protocol.DetokenizeRequest) -> str:
    check_model(state, body.model)
    vocab_size = state.admission.vocab_size
    bad = [i for i, token in enumerate(body.tokens) if token >= vocab_size]
    if bad:
        raise bad_request(f"token ids must be in [0, {vocab_size}); got {body.tokens[bad[0]]}",
                          f"tokens[{bad[0]}]")
    return state.admission.tokenizer.decode(body.tokens)


# -- the plan -----------------------------------------------------------------------------------

def plan(state: ServerState, kind: Kind, body: RequestBody) -> list[PlannedSequence]:
    """Tokenize, fill in max_tokens and seeds, and run every engine check: 400s happen here.
    Blocking (tokenizing a long prompt takes a while): callers run it in a worker thread."""
    admission = state.admission
    tools = _tools(state, body) if kind == "chat" else None
    if kind == "chat" and body.image_parts():
        refusal = state.image_refusal()
        if refusal is not None:
            first_part = body.image_parts()[0][0].removesuffix(".image_url")
            raise bad_request(refusal, first_part, code="unsupported")
    prompts = _prompts(admission, kind, body, state.limits)
    reasoning = _reasoning(state, body, prompts[0].ids) if kind == "chat" else None
    base = _base_params(body, state.default_seed() if body.seed is None else body.seed, reasoning, tools)
    sequences = []
    for prompt_index, prompt in enumerate(prompts):
        max_tokens = _max_tokens(admission, body, len(prompt.ids), state.limits)
        for j in range(body.n):
            params = _params_for(body, base, max_tokens, j)
            with refusals_as_400(body):
                admission.check_request(prompt.ids, params)
            sequences.append(PlannedSequence(
                prompt_index * body.n + j, prompt_index, prompt.ids, params, tools, prompt.echo,
                body.prompt_logprobs, body.logprobs if isinstance(body, CompletionRequest) and body.echo
                else None, reasoning, images=prompt.images))
    return sequences


def _tools(state: ServerState, body: ChatCompletionRequest) -> ToolPlan | None:
    """The chat's tools, read back in the served model's format (`serve --tool-call-parser`)."""
    if not body.tools:
        return ToolPlan.from_body(body)
    tool_format = resolve_format(state.tool_call_parser, state.admission.tokenizer, body.chat_template)
    return ToolPlan.from_body(body, tool_format)


def _reasoning(state: ServerState, body: ChatCompletionRequest,
               prompt_ids: list[int]) -> ReasoningPlan | None:
    """The chat's think block, when the server runs a reasoning parser for this model."""
    tokenizer = state.admission.tokenizer
    with refusals_as_400(body):
        tags = state.reasoning.tags(tokenizer)
    if tags is None:
        if body.thinking_token_budget is not None:
            raise bad_request("thinking_token_budget needs a reasoning parser (serve --reasoning-parser) "
                              "and a model with think tags", "thinking_token_budget", code="unsupported")
        return None
    budget = body.thinking_token_budget
    return ReasoningPlan.for_prompt(tags, prompt_ids, tokenizer, include=body.include_reasoning,
                                    budget_tokens=state.reasoning.budget_tokens if budget is None else budget)


def _prompts(admission: InputProcessor, kind: Kind, body: RequestBody,
             limits: ServerLimits) -> list[PlannedPrompt]:
    if kind == "chat" and body.image_parts():
        return [_image_chat_prompt(admission, body, limits)]
    if kind == "chat":
        return [PlannedPrompt(_chat_prompt_ids(admission, body))]
    prompt = body.prompt
    single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
    prompts = [prompt] if single else list(prompt)
    if not prompts:
        raise bad_request("prompt is empty: give a string, a list of token ids or a list of prompts",
                          "prompt")
    if len(prompts) > limits.max_prompts:
        raise bad_request(f"at most {limits.max_prompts} prompts per request; got {len(prompts)}", "prompt")
    return [_completion_prompt(admission, body, p, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
            for i, p in enumerate(prompts)]


def _completion_prompt(admission: InputProcessor, body: CompletionRequest, prompt: str | list[int],
                       param: str) -> PlannedPrompt:
    if isinstance(prompt, str) and body.add_special_tokens is False:
        prompt = admission.tokenizer.encode(prompt, add_bos=False) or prompt  # "": refused as empty below
    ids = _encode(admission, body, prompt, param)
    if not body.echo:
        return PlannedPrompt(ids)
    # vLLM echoes a text prompt as sent; token ids (or a truncated prompt) as they decode.
    whole = isinstance(prompt, str) and body.truncate_prompt_tokens is None
    text = prompt if whole else admission.tokenizer.decode(
        ids, skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens)
    return PlannedPrompt(ids, text)


def _chat_prompt_ids(admission: InputProcessor, body: ChatCompletionRequest) -> list[int]:
    try:
        messages = body.chat_messages()
    except protocol.UnsupportedContentError as error:
        raise bad_request(str(error), error.param) from None
    tools = ToolPlan.from_body(body)
    with refusals_as_400(body):
        prompt_ids = admission.tokenizer.encode_chat(messages, tools=tools and tools.template_tools(),
                                                  **body.template_flags(),
                                                  add_special_tokens=bool(body.add_special_tokens))
    return _encode(admission, body, prompt_ids, "messages")


def _image_chat_prompt(admission: InputProcessor, body: ChatCompletionRequest,
                       limits: ServerLimits) -> PlannedPrompt:
    """A chat with images: each image fetched or decoded (a 400 names its part), the template
    rendered with the model's placeholders, expanded, encoded, and the images placed."""
    side, tokenizer = admission.images, admission.tokenizer
    parts = body.image_parts()
    with refusals_as_400(body):
        side.limits.check_count(len(parts), "messages")
        images = [load_image(url, param, limits.media, side.limits) for param, url in parts]
        template = body.chat_template or tokenizer.chat_template
        messages = body.chat_messages(side.processor.placeholder,
                                      content_parts=template_reads_parts(template))
    tools = ToolPlan.from_body(body)
    add_bos = None if body.add_special_tokens else False
    with refusals_as_400(body, param="messages"):
        text = tokenizer.apply_chat_template(messages, tools=tools and tools.template_tools(),
                                             **body.template_flags())
        ids, placed = side.prompt(text, images, lambda pieces: admission.encode_pieces(pieces, add_bos),
                                  lambda ids: keep_last_tokens(ids, body.truncate_prompt_tokens),
                                  field="messages")
    return PlannedPrompt(ids, images=tuple(placed))


def _encode(admission: InputProcessor, body: RequestBody, prompt: str | list[int], param: str) -> list[int]:
    """The prompt's token ids, checked, and truncated as truncate_prompt_tokens asks."""
    with refusals_as_400(body, param=param):
        ids = admission.encode_prompt(prompt)
    return keep_last_tokens(ids, body.truncate_prompt_tokens)


LLAMA_CPP_SAMPLER_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                            "dry_sequence_breakers", "xtc_probability", "xtc_threshold", "mirostat",
                            "mirostat_tau", "mirostat_eta")


def _base_params(body: RequestBody, seed: int | None, reasoning: ReasoningPlan | None = None,
                 tools: ToolPlan | None = None) -> SamplingParams:
    """The sampling fields every choice shares; `_params_for` sets the rest per choice."""
    fields: dict[str, Any] = {
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "typical_p": body.typical_p, "top_n_sigma": body.top_n_sigma,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos, "seed": seed, "cache_salt": body.cache_salt,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "prompt_logprobs": prompt_logprobs_asked(body),
        "bad_words": body.bad_words, "allowed_token_ids": body.allowed_token_ids,
        "stop": body.stop, "stop_token_ids": body.stop_token_ids,
        "logprobs": _top_logprobs(body)[0],
        "logit_bias": _logit_bias(body.logit_bias),
        "p_less": body.p_less, "structured_outputs": _constraint(body, reasoning, tools),
        "priority": body.priority,
        **{name: getattr(body, name) for name in LLAMA_CPP_SAMPLER_FIELDS},
    }
    if tools is not None and tools.shows_special_tokens:  # the format's markers are special tokens
        fields["skip_special_tokens"], fields["spaces_between_special_tokens"] = False, False
    given = {name: value for name, value in fields.items() if value is not None}
    # max_tokens is set per prompt (`_params_for`); this placeholder only has to admit min_tokens.
    given["max_tokens"] = max(1, body.min_tokens or 0)
    with refusals_as_400(body):
        return SamplingParams(**given)


def prompt_logprobs_asked(body: RequestBody) -> int | None:
    """How many alternatives per prompt position the engine scores: what prompt_logprobs asks,
    or completions' echo with logprobs (OpenAI's prompt tokens in the logprobs), the more of the two."""
    echoed = body.logprobs if isinstance(body, CompletionRequest) and body.echo else None
    asked = [n for n in (body.prompt_logprobs, echoed) if n is not None]
    return max(asked) if asked else None


def _constraint(body: RequestBody, reasoning: ReasoningPlan | None,
                tools: ToolPlan | None) -> StructuredOutputs | None:
    """The one grammar the output follows: the tools' (tool_choice required or named; "auto"'s
    lazy grammar unless the body asks for what a grammar cannot share a request with: a
    structured output, which then wins, min_tokens, allowed_token_ids or bad_words), or the
    structured-output fields', after the think block of a reasoning model (which alone is a
    grammar when the thinking has a budget)."""
    asked = structured_outputs(body)
    from_tools = None
    yields = asked is not None or body.min_tokens or body.allowed_token_ids is not None or body.bad_words
    if tools is not None and not (tools.choice == "auto" and yields):
        from_tools = tools.constraint()
    if from_tools is not None and asked is not None:
        raise bad_request(f"tool_choice {tools.choice!r} constrains the output already; drop "
                          f"{asked.param.split('.')[0]}", asked.param.split(".")[0])
    answer = from_tools or asked
    return reasoning.constraint(answer) if reasoning is not None else answer


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, so as strings; the engine wants ints."""
    if bias is None:
        return None
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise bad_request(f"logit_bias must have at most {MAX_LOGIT_BIAS_TOKENS} tokens; got {len(bias)}",
                          "logit_bias")
    out = {}
    for key, value in bias.items():
        token = key.strip()
        if not token.isascii() or not token.isdigit() or len(token) > 10:
            raise bad_request(f"logit_bias keys must be token ids (decimal strings); got {key!r}",
                              "logit_bias")
        if int(token) in out:  # "5", " 5" and "05" are one token: refuse rather than keep one
            raise bad_request(f"logit_bias names token {int(token)} twice; got {key!r}", "logit_bias")
        out[int(token)] = value
    return out


def _max_tokens(admission: InputProcessor, body: RequestBody, num_prompt: int, limits: ServerLimits) -> int:
    """What the body asks for, within the server's limit. Absent, as OpenAI and vLLM have it:
    16 for a completion, and for a chat all the room the context leaves (within the limit)."""
    asked = body.max_tokens
    name = "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        asked, name = body.max_completion_tokens, "max_completion_tokens"
    if asked is None and isinstance(body, CompletionRequest):
        asked = protocol.COMPLETION_DEFAULT_MAX_TOKENS
        if limits.max_tokens is not None:
            asked = min(asked, limits.max_tokens)
    if asked is not None:
        if limits.max_tokens is not None and asked > limits.max_tokens:
            raise bad_request(f"{name} must be at most {limits.max_tokens} on this server; got {asked}", name)
        return asked
    room = admission.max_request_tokens - num_prompt
    if room < 1:
        raise bad_request(f"the prompt has {num_prompt} tokens, which leaves no room to generate in this "
                          f"server's context of {admission.max_request_tokens} tokens",
                          "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
    return room if limits.max_tokens is None else min(room, limits.max_tokens)


def _params_for(body: RequestBody, base: SamplingParams, max_tokens: int, j: int) -> SamplingParams:
    """Choice j's parameters: its prompt's max_tokens, the rest as `SamplingParams.for_choice`."""
    with refusals_as_400(body):
        return dataclasses.replace(base.for_choice(j), max_tokens=max_tokens)
