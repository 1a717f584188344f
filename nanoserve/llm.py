"""`LLM`: the thin offline and streaming front over one `Engine`, in vLLM's shapes.

`generate` runs a batch of prompts to completion through continuous batching, with a progress
bar; `chat` renders one conversation or a batch of them first; `stream` yields one request's
deltas as they land; `embed` pools each prompt's final hidden states into one vector (vLLM's
`LLM.embed`: `.outputs.embedding`), with any model, or an embedding model with
`LLM(model, task="embed")`. All drive the same step loop the server and `nanoserve generate`
use: there is one decode path in the project.

Code written for vLLM's offline API runs unchanged for what both have:
`llm.generate(prompts, sampling_params)` takes a string, token ids, `{"prompt": ...}` or
`{"prompt_token_ids": ...}` (optionally with `"cache_salt"`), or a list of them; each result
has `.prompt`, `.prompt_token_ids` and `.outputs[i]` (`.text`, `.token_ids`, `.logprobs`,
`.finish_reason`, `.stop_reason`, `.cumulative_logprob`), one per `SamplingParams.n`, and
`.prompt_logprobs` when `SamplingParams.prompt_logprobs` asks (scored once, by choice 0). Beside
vLLM's shape, a result's own `.text`, `.token_ids`, `.logprobs` and `.finish_reason` are its
first output's. Differences: `.logprobs` is a list of `TokenLogprob` (id, logprob, top
alternatives), not vLLM's dict per position, and so is `.prompt_logprobs` (None first, as
vLLM; each entry's `rank` set; None too at an image's rows whose id lies outside the vocabulary,
`.prompt_token_ids` holding that id there); there is no `use_tqdm` (`progress`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.engine.output import RequestOutput, TokenLogprob
from nanoserve.errors import InvalidRequestError
from nanoserve.model.lora import LoRARequest
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import Tokenizer

PromptDict = Mapping[str, Any]  # vLLM's TextPrompt and TokensPrompt
Prompt = str | Sequence[int] | PromptDict
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"})


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a finished request (vLLM's CompletionOutput): every delta joined."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the chosen tokens' logprobs; None unless logprobs were asked for (as vLLM)."""
        return None if self.logprobs is None else sum(entry.logprob for entry in self.logprobs)

    def add(self, output: RequestOutput) -> None:
        self.text += output.text
        self.token_ids += output.token_ids
        if output.logprobs is not None:
            self.logprobs = (self.logprobs or []) + output.logprobs
        if output.finished:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason


@dataclass(slots=True)
class Completion:
    """A finished prompt: its `outputs` (n of them), and the first one's fields as its own."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None = None  # the prompt text, when it was given as text
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput(0)])
    # SamplingParams.prompt_logprobs: entry p scores prompt token p given those before it (0: None;
    # None too where token p is an image's placeholder outside the vocabulary)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def finished(self) -> bool:
        return all(output.finish_reason is not None for output in self.outputs)


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(frozen=True, slots=True)
class Embedding:
    """One prompt's vector (vLLM's EmbeddingRequestOutput: `.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput

    @property
    def embedding(self) -> list[float]:
        return self.outputs.embedding


class LLM:
    def __init__(self, model: str | None = None, **engine_options: object) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = Engine(config)
        return llm

    def close(self) -> None:
        """Write the prefix cache to its directory (`prefix_cache_dir`) and stop any workers."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 progress: bool | None = None) -> list[Completion]:
        """Run every prompt to completion; results in prompt order, `n` outputs each.

        `params` is the same as `sampling_params` (nanoserve's older name). `priority` (vLLM's:
        one per prompt, or one for all) sets each prompt's `SamplingParams.priority`;
        `lora_request` (vLLM's: one for all prompts, or one per prompt, None for the base
        model) the adapter each runs with, with `LLM(enable_lora=True)`. `progress`
        shows a rich progress bar; by default only when stderr is a terminal.
        """
        if progress is None:
            progress = sys.stderr.isatty()
        prompt_list = [prompts] if _is_single(prompts) else list(prompts)
        params_list = _params_per_prompt(sampling_params if params is None else params, len(prompt_list))
        params_list = _with_priorities(params_list, priority)
        loras = _loras_per_prompt(lora_request, len(prompt_list))
        engine = self.engine
        completions: dict[str, Completion] = {}  # by the request id of each prompt's choice 0
        choices: dict[str, CompletionOutput] = {}
        parent_id = None  # one call is one client request for the fair share: its first request
        for prompt, prompt_params, lora in zip(prompt_list, params_list, loras, strict=True):
            text, ids_or_text, prompt_params = _unpack(prompt, prompt_params)
            completion = None
            for i in range(prompt_params.n):
                request_id = engine.add_request(ids_or_text, prompt_params.for_choice(i), parent_id=parent_id,
                                                lora_request=lora, images=_images(prompt))
                parent_id = parent_id or request_id
                if completion is None:
                    completion = Completion(request_id, engine.requests[request_id].prompt_ids, text, [])
                    completions[request_id] = completion
                completion.outputs.append(CompletionOutput(i))
                choices[request_id] = completion.outputs[-1]
        with Progress(disable=not progress, transient=True, console=Console(stderr=True)) as bar:
            task = bar.add_task("generating", total=len(choices))
            while engine.has_unfinished():
                for output in engine.step():
                    choices[output.request_id].add(output)
                    if output.prompt_logprobs is not None:
                        completions[output.request_id].prompt_logprobs = output.prompt_logprobs
                    bar.advance(task, int(output.finished))
        return list(completions.values())

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, *,
              lora_request: LoRARequest | None = None) -> list[Embedding]:
        """Each prompt's pooled vector, in prompt order, through the same batched steps as
        generation (prefill only); `pooling_params` for all of them (default: the engine's
        method, normalized)."""
        prompt_list = [prompts] if _is_single(prompts) else list(prompts)
        pooling_params = pooling_params or PoolingParams()
        engine, vectors = self.engine, {}
        request_ids, parent_id = [], None
        for prompt in prompt_list:
            _, ids_or_text, params = _unpack(prompt, SamplingParams())
            request_id = engine.add_request(ids_or_text, params, parent_id=parent_id,
                                            lora_request=lora_request, pooling=pooling_params)
            parent_id = parent_id or request_id
            request_ids.append((request_id, engine.requests[request_id].prompt_ids))
        while engine.has_unfinished():
            for output in engine.step():
                if output.embedding is not None:
                    vectors[output.request_id] = output.embedding
        return [Embedding(request_id, prompt_ids, EmbeddingOutput(vectors[request_id]))
                for request_id, prompt_ids in request_ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they land; closing the iterator aborts the request."""
        engine = self.engine
        _, ids_or_text, params = _unpack(prompt, params or SamplingParams())
        request_id = engine.add_request(ids_or_text, params, images=_images(prompt))
        finished = False
        try:
            while not finished:
                for output in engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                engine.abort(request_id)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             progress: bool | None = None) -> list[Completion]:
        """One conversation (a list of messages) or a batch of them, each rendered by the chat
        template (the model's, or `chat_template`), then generated; as vLLM's `LLM.chat`.
        `tools` reach the template as its `tools` variable (tool calls are not parsed yet)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        extra = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        prompt_ids = [self.tokenizer.encode_chat(
            list(conversation), add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            template_kwargs=extra) for conversation in conversations]
        return self.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                             sampling_params if params is None else params, progress=progress)

    def prompt_logits(self, prompts: Sequence[str | Sequence[int]]) -> torch.Tensor:
        return self.engine.prompt_logits(prompts)


def _is_single(prompts: object) -> bool:
    return isinstance(prompts, str | Mapping) or _is_token_ids(prompts)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, Sequence) and bool(value) and all(isinstance(t, int) for t in value)


def _unpack(prompt: Prompt, params: SamplingParams) -> tuple[str | None, str | list[int], SamplingParams]:
    """(prompt text if any, what the engine encodes, params with the prompt's cache_salt)."""
    if isinstance(prompt, str):
        return prompt, prompt, params
    if not isinstance(prompt, Mapping):
        return None, list(prompt), params
    unknown = sorted(set(prompt) - PROMPT_KEYS)
    if unknown:
        raise InvalidRequestError(f"prompt keys {unknown} are not supported (only {sorted(PROMPT_KEYS)})",
                                  param="prompt")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'",
                                  param="prompt")
    if "cache_salt" in prompt:
        params = dataclasses.replace(params, cache_salt=prompt["cache_salt"])
    if "prompt" in prompt:
        return prompt["prompt"], prompt["prompt"], params
    return None, list(prompt["prompt_token_ids"]), params


def _images(prompt: Prompt) -> list | None:
    """A prompt dict's images (vLLM's `multi_modal_data={"image": one or a list}`): image file
    bytes or PIL images, one per placeholder in its text."""
    if not isinstance(prompt, Mapping) or "multi_modal_data" not in prompt:
        return None
    data = prompt["multi_modal_data"]
    if not isinstance(data, Mapping) or set(data) != {"image"}:
        raise InvalidRequestError("multi_modal_data must be a dict with one key, 'image'",
                                  param="multi_modal_data")
    images = data.get("image")
    return list(images) if isinstance(images, list | tuple) else [images]


def _with_priorities(params_list: list[SamplingParams],
                     priority: int | Sequence[int] | None) -> list[SamplingParams]:
    if priority is None:
        return params_list
    if not isinstance(priority, Sequence):
        priority = [priority] * len(params_list)
    if len(priority) != len(params_list):
        raise InvalidRequestError(f"got {len(priority)} priorities for {len(params_list)} prompts",
                                  param="priority")
    return [dataclasses.replace(params, priority=value)
            for params, value in zip(params_list, priority, strict=True)]


def _loras_per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise InvalidRequestError(f"got {len(loras)} LoRA requests for {count} prompts", param="lora_request")
    return loras


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                       count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
