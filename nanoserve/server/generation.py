"""Generation: one request's planned sequences running on the engine thread, and unary answers.

Owns: admission (`check_capacity`: a 400 for a request that could never fit, a 503 while the
server is full), `Generation` (adds the sequences under their tenant's cache scope and fair
share parent, reads their outputs from one queue, records their latencies and their tenant's
counts, aborts whatever is still running on `close` and leaves the tenant's in-flight count),
and the unary response: collect every output, or stop early and abort if the client hangs up.
Refuses: deciding what a request may ask for (planning did), SSE (`streaming`), and touching
the engine other than through the `EngineBridge` (bridges/engine_bridge.py).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.server.bridges.engine_bridge import EngineUnavailableError
from nanoserve.server.errors import bad_request
from nanoserve.server.openai import protocol
from nanoserve.server.openai.protocol import Kind, TextOffset, TokenText
from nanoserve.server.state import ServerState, unavailable

if TYPE_CHECKING:
    from nanoserve.engine.output import RequestOutput, TokenLogprob
    from nanoserve.model.lora import LoRARequest
    from nanoserve.server.parsers.reasoning import ReasoningReader
    from nanoserve.server.parsers.tool_calls import ToolCallReader
    from nanoserve.server.planning import PlannedSequence
    from nanoserve.server.tenants import Tenant


def check_capacity(state: ServerState, num_sequences: int) -> None:
    engine = state.async_engine
    capacity = engine.max_running + state.limits.max_waiting
    if num_sequences > capacity:
        raise bad_request(f"this request asks for {num_sequences} sequences (prompts x n); this server "
                          f"holds at most {capacity} at a time", "n")
    if engine.num_in_flight + num_sequences > capacity:
        raise unavailable(f"the server is at capacity ({capacity} sequences in flight); retry shortly",
                          state.limits)


def new_request_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


@dataclass(slots=True)
class Choice:
    """One sequence's output so far and its timings."""

    index: int
    prompt_index: int
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stop_token_ids: tuple[int, ...] = ()
    echo: str = ""  # text before the generated text (completions' echo)
    first_s: float = 0.0  # when its first output came (0: none yet)
    last_s: float = 0.0
    text_offset: TextOffset = field(default_factory=TextOffset)  # streamed completion logprobs
    aborted: bool = False  # ended with no finish: by the server, or by `close` (hang-up, failure)
    tool_reader: ToolCallReader | None = None  # a chat with tools: reads calls out of the text
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # scored by a prompt's first choice
    prompt_logprobs_asked: int | None = None  # vLLM's prompt_logprobs field
    echo_logprobs: int | None = None  # completions' echo with logprobs N
    reasoning: ReasoningReader | None = None  # a reasoning model's chat: thinking apart from content
    reasoning_shown: bool = True  # include_reasoning
    embedding: list[float] | None = None  # an embedding request's vector

    @property
    def reported_finish_reason(self) -> str | None:
        """OpenAI's "tool_calls" when the reply ended by making calls."""
        calls = self.tool_reader is not None and self.tool_reader.streamed_calls
        return "tool_calls" if calls and self.finish_reason == "stop" else self.finish_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Generation:
    """The sequences of one HTTP request, read from one queue the engine thread feeds."""

    state: ServerState
    request_id: str
    arrival_s: float
    queue: asyncio.Queue
    choices: dict[str, Choice]
    tenant: Tenant | None = None
    error: BaseException | None = None
    closed: bool = False

    @classmethod
    def start(cls, state: ServerState, plan: list[PlannedSequence], arrival_s: float, *,
              request_id: str, tenant: Tenant | None, lora_request: LoRARequest | None = None) -> Generation:
        """Add the plan's sequences as one client request of `tenant` (None: the server has no
        keys), run with the LoRA adapter `lora_request` (None: the base model): its cache scope
        salts their params, its fair share parent groups them."""
        queue: asyncio.Queue = asyncio.Queue()
        ids = [f"{request_id}-{seq.index}" for seq in plan]
        choices = {seq_id: Choice(seq.index, seq.prompt_index, seq_id, len(seq.prompt_ids),
                                  stop_token_ids=seq.params.stop_token_ids, echo=seq.echo,
                                  tool_reader=seq.tools.reader() if seq.tools is not None else None,
                                  prompt_ids=seq.prompt_ids, prompt_logprobs_asked=seq.prompt_logprobs,
                                  echo_logprobs=seq.echo_logprobs,
                                  reasoning=seq.reasoning.reader() if seq.reasoning is not None else None,
                                  reasoning_shown=seq.reasoning is None or seq.reasoning.include)
                   for seq_id, seq in zip(ids, plan, strict=True)}
        generation = cls(state, request_id, arrival_s, queue, choices, tenant)
        tenancy = state.tenancy
        tenancy.enter(tenant)
        parent_id = tenancy.parent_id(tenant, request_id)
        # Only the in-process engine serves adapters (build_app refuses them beside replicas).
        adapter = {"lora_request": lora_request} if lora_request is not None else {}
        # Only the in-process engine takes images (planning refuses them beside replicas).
        for seq_id, seq in zip(ids, plan, strict=True):
            try:
                params = tenancy.scoped_params(seq.params, tenant)
                images = {"images": seq.images} if seq.images else {}
                state.async_engine.add(seq_id, seq.prompt_ids, params, queue, parent_id=parent_id,
                                       pooling=seq.pooling, **adapter, **images)
            except EngineUnavailableError as error:
                generation.close()
                raise unavailable(str(error), state.limits) from None
        return generation

    @property
    def done(self) -> bool:
        return self.error is not None or all(choice.finished for choice in self.choices.values())

    async def next_outputs(self) -> list[tuple[Choice, RequestOutput]]:
        """Wait for at least one output, then take all that are ready."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        outputs = []
        for item in items:
            if isinstance(item, BaseException):
                self.error = item
                continue
            choice = self.choices[item.request_id]
            self._record(choice, item)
            outputs.append((choice, item))
        return outputs

    def _record(self, choice: Choice, output: RequestOutput) -> None:
        now = time.perf_counter()
        metrics = self.state.metrics
        if choice.num_tokens == 0:
            metrics.ttft.observe(now - self.arrival_s)
            choice.first_s = choice.first_s or now
        else:
            metrics.itl.observe(now - choice.last_s)
        choice.last_s = now
        choice.num_tokens = output.num_output_tokens
        if choice.reasoning is not None:
            choice.reasoning.count(output.token_ids)
        choice.num_cached_tokens = output.num_cached_tokens
        if output.embedding is not None:
            choice.embedding = output.embedding
        if output.prompt_logprobs is not None:
            choice.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            if output.finish_reason == "abort":
                self.error = EngineUnavailableError("the request was aborted by the server")
                self._count_abort(choice)
                return
            choice.finish_reason, choice.stop_reason = output.finish_reason, output.stop_reason
            if isinstance(output.stop_reason, int) and output.stop_reason not in choice.stop_token_ids:
                choice.stop_reason = None  # EOS, as vLLM reports it; a stop_token_ids hit names its id
            metrics.e2e.observe(now - self.arrival_s)
            metrics.count_finished(output.finish_reason, self._tenant_name)

    def close(self) -> None:
        """Abort every sequence still running (the client left, or the request failed); the
        first call also counts the request for its tenant and leaves its in-flight count."""
        for choice in self.choices.values():
            if not choice.finished and not choice.aborted:
                self.state.async_engine.abort(choice.request_id)
                self._count_abort(choice)
        if self.closed:
            return
        self.closed = True
        self.state.tenancy.leave(self.tenant)
        if self.tenant is not None:
            usage = self.usage()
            self.state.metrics.count_tokens(self.tenant.name, usage["prompt_tokens"],
                                            usage["completion_tokens"])

    @property
    def _tenant_name(self) -> str | None:
        return self.tenant.name if self.tenant is not None else None

    def _count_abort(self, choice: Choice) -> None:
        choice.aborted = True
        self.state.metrics.count_finished("abort", self._tenant_name)

    def usage(self) -> dict[str, Any]:
        prompt_tokens = {c.prompt_index: c.num_prompt_tokens for c in self.choices.values()}
        cached = {c.prompt_index: c.num_cached_tokens for c in self.choices.values()}  # as prompts: once
        completion = sum(c.num_tokens for c in self.choices.values())
        readers = [c.reasoning for c in self.choices.values() if c.reasoning is not None]
        reasoning = sum(r.num_reasoning_tokens for r in readers) if readers else None
        return protocol.usage(sum(prompt_tokens.values()), completion, sum(cached.values()), reasoning)


# -- the unary response -------------------------------------------------------------------------

async def unary_response(request: Request, kind: Kind, generation: Generation, model: str,
                         translate: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Response:
    """The whole answer once every choice is done; `translate` turns the chat completion body
    into another protocol's (Messages, Responses)."""
    try:
        await until_done_or_disconnect(request, generation)
    except ClientDisconnectedError:
        return Response(status_code=499)  # nobody is listening; the sequences are aborted below
    finally:
        generation.close()
    body = _unary_body(kind, generation, model)
    return JSONResponse(translate(body) if translate is not None else body)


class ClientDisconnectedError(Exception):
    """The client hung up before its unary response was ready."""


async def until_done_or_disconnect(request: Request, generation: Generation) -> None:
    """Collect every output; if the client hangs up first, stop (the caller aborts)."""
    async def collect() -> None:
        while not generation.done:
            for choice, output in await generation.next_outputs():
                choice.texts.append(output.text)
                if output.logprobs is not None:
                    choice.logprobs = (choice.logprobs or []) + output.logprobs

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collecting, watching):
            task.cancel()
    if collecting.done() and not collecting.cancelled():
        collecting.result()
    if not generation.done:
        raise ClientDisconnectedError
    if generation.error is not None:
        raise unavailable(str(generation.error), generation.state.limits)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _unary_body(kind: Kind, generation: Generation, model: str) -> dict[str, Any]:
    body = protocol.envelope(kind, generation.request_id, model, protocol.now_s(), chunk=False)
    names = token_text(generation.state)
    ordered = sorted(generation.choices.values(), key=lambda c: c.index)
    scored = {c.prompt_index: c.prompt_logprobs for c in ordered if c.prompt_logprobs is not None}
    choices = []
    for choice in ordered:
        logprobs = _choice_logprobs(kind, choice, scored.get(choice.prompt_index), names)
        text = choice.echo + "".join(choice.texts)
        if kind == "chat":
            choices.append(_chat_choice(choice, text, logprobs))
            continue
        choices.append(protocol.completion_choice(choice.index, text, logprobs, choice.finish_reason,
                                                  choice.stop_reason))
        if kind == "completion" and choice.prompt_logprobs_asked is not None:  # vLLM's, per choice
            choices[-1]["prompt_logprobs"] = _prompt_logprobs(choice, scored, names)
    body["choices"] = choices
    if kind == "chat" and ordered[0].prompt_logprobs_asked is not None:  # vLLM's, once per response
        body["prompt_logprobs"] = _prompt_logprobs(ordered[0], scored, names)
    body["usage"] = generation.usage()
    return body


def _chat_choice(choice: Choice, text: str, logprobs: dict | None) -> dict[str, Any]:
    """A chat choice: the thinking apart (reasoning models), then the answer's tool calls."""
    reasoning = None
    if choice.reasoning is not None:
        reasoning, text = choice.reasoning.split(text)
        reasoning = reasoning if choice.reasoning_shown else None
    content, calls, finish_reason = text, None, choice.finish_reason
    if choice.tool_reader is not None and choice.finish_reason in ("stop", "length"):
        cut = choice.finish_reason == "length"
        content, calls = choice.tool_reader.read(text, cut=cut)
        finish_reason = "tool_calls" if calls and not cut else choice.finish_reason
    return protocol.chat_choice(choice.index, content, logprobs, finish_reason, choice.stop_reason, calls,
                                reasoning)


def _choice_logprobs(kind: Kind, choice: Choice, prompt_entries: list[TokenLogprob | None] | None,
                     names: TokenText) -> dict | None:
    """The choice's logprobs; with completions' echo, the prompt's tokens first (OpenAI's shape:
    the first token has no logprob), offsets running on into the generated text."""
    if choice.echo_logprobs is None:
        return logprobs_body(kind, choice.logprobs, names, 0) if choice.logprobs is not None else None
    offset = TextOffset()
    prompt = protocol.echo_logprobs(choice.prompt_ids, prompt_entries, names, offset, choice.echo_logprobs)
    generated = protocol.completion_logprobs(choice.logprobs or [], names, offset)
    return {key: prompt[key] + generated[key] for key in prompt}


def _prompt_logprobs(choice: Choice, scored: dict[int, list[TokenLogprob | None]],
                     names: TokenText) -> list[dict | None]:
    return protocol.prompt_logprobs_body(scored[choice.prompt_index], choice.prompt_logprobs_asked, names)


# -- shared with streaming ----------------------------------------------------------------------

def logprobs_body(kind: Kind, entries: list[TokenLogprob], names: TokenText,
                  text_offset: int | TextOffset) -> dict:
    if kind == "chat":
        return protocol.chat_logprobs(entries, names)
    return protocol.completion_logprobs(entries, names, text_offset)


def token_text(state: ServerState) -> TokenText:
    """The tokens' text and bytes, built on first use: the tokenizer exists only once loaded."""
    if state.token_text is None:
        state.token_text = TokenText(state.admission.tokenizer)
    return state.token_text
