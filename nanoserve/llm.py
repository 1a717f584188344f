"""`LLM`: the thin offline and streaming front over one `Engine`.

`generate` runs a batch of prompts to completion through continuous batching, with a progress
bar; `stream` yields one request's deltas as they land. Both drive the same step loop the
server and `nanoserve generate` use: there is one decode path in the project.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.progress import Progress

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.output import RequestOutput, TokenLogprob
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass(slots=True)
class Completion:
    """A finished request: every delta of its `RequestOutput`s, joined."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, output: RequestOutput) -> None:
        self.text += output.text
        self.token_ids += output.token_ids
        if output.logprobs is not None:
            self.logprobs = (self.logprobs or []) + output.logprobs
        if output.finished:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason


class LLM:
    def __init__(self, model: str | None = None, **engine_options: object) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = Engine(config)
        return llm

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool | None = None) -> list[Completion]:
        """Run every prompt to completion; results in prompt order.

        `progress` shows a rich progress bar; by default only when stderr is a terminal.
        """
        if progress is None:
            progress = sys.stderr.isatty()
        prompts = [prompts] if isinstance(prompts, str) or _is_token_ids(prompts) else list(prompts)
        params_list = _params_per_prompt(params, len(prompts))
        engine = self.engine
        completions = {}
        for prompt, prompt_params in zip(prompts, params_list, strict=True):
            request_id = engine.add_request(prompt, prompt_params)
            completions[request_id] = Completion(request_id, engine.requests[request_id].prompt_ids)
        with Progress(disable=not progress, transient=True, console=Console(stderr=True)) as bar:
            task = bar.add_task("generating", total=len(prompts))
            while engine.has_unfinished():
                for output in engine.step():
                    completions[output.request_id].add(output)
                    bar.advance(task, int(output.finished))
        return list(completions.values())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they land; closing the iterator aborts the request."""
        engine = self.engine
        request_id = engine.add_request(prompt, params)
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

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]

    def prompt_logits(self, prompts: Sequence[Prompt]) -> torch.Tensor:
        return self.engine.prompt_logits(prompts)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, Sequence) and bool(value) and all(isinstance(t, int) for t in value)


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                       count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
