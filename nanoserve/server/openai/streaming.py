"""Streaming: a running `Generation` as server-sent events, OpenAI's chunk format.

Owns: `stream_response` (the SSE response, which aborts the generation however it ends:
done, hang-up or cancel), the chunks (the chat role chunk first, then one chunk per choice
with new text, logprobs or a finish), a keep-alive comment after each quiet
`sse_keep_alive_s`, the usage chunk for `include_usage`, and always a
well-formed end: an error event when the engine failed or the server is shutting down, then
`[DONE]`.
Refuses: deciding what a request may ask for (planning) and running the sequences
(generation); a failure after the first byte can only be an event, never a status code.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from nanoserve.server.errors import APIError
from nanoserve.server.generation import Choice, Generation, logprobs_body, token_text
from nanoserve.server.openai import protocol
from nanoserve.server.openai.protocol import Kind, RequestBody, TokenText
from nanoserve.server.state import unavailable

if TYPE_CHECKING:
    from nanoserve.engine.output import RequestOutput

log = logging.getLogger("nanoserve.server")
SSE_DONE = "data: [DONE]\n\n"
# An SSE comment: clients ignore it, but it keeps proxies and idle timeouts from cutting a
# stream that waits in the queue or behind a long prefill.
SSE_KEEP_ALIVE = ": keep-alive\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (done, hang-up, cancel)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], *, on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def stream_response(kind: Kind, generation: Generation, model: str, body: RequestBody) -> EventStreamResponse:
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(include_usage and options.continuous_usage_stats)
    events = _stream_events(kind, generation, model, include_usage, continuous)
    return EventStreamResponse(events, on_close=generation.close)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream_events(kind: Kind, generation: Generation, model: str,
                         include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    created = protocol.now_s()
    head = protocol.envelope(kind, generation.request_id, model, created, chunk=True)
    if include_usage:
        head["usage"] = None
    try:
        async for events in _chunks(kind, generation, head, continuous_usage):
            yield events
        if generation.error is not None:
            yield sse(unavailable(str(generation.error), generation.state.limits).body())
        elif include_usage:
            yield sse({**head, "choices": [], "usage": generation.usage()})
    except Exception as error:  # a bug: the client still gets a well-formed end of stream
        log.exception("error while streaming %s", generation.request_id)
        yield sse(APIError(500, f"internal error: {type(error).__name__}").body())
    yield SSE_DONE


async def _chunks(kind: Kind, generation: Generation, head: dict[str, Any],
                  continuous_usage: bool) -> AsyncIterator[str]:
    async for batch in chunk_batches(kind, generation, head, continuous_usage):
        yield SSE_KEEP_ALIVE if batch is None else "".join(sse(chunk) for chunk in batch)


async def chunk_batches(kind: Kind, generation: Generation, head: dict[str, Any],
                        continuous_usage: bool = False) -> AsyncIterator[list[dict[str, Any]] | None]:
    """The chunks with content, a batch at a time as they come (None: a quiet keep-alive
    interval went by); with `continuous_usage` (vLLM's continuous_usage_stats) each also
    carries the usage so far. Other protocols' streams (Messages, Responses) read these."""
    names = token_text(generation.state)
    ordered = sorted(generation.choices.values(), key=lambda c: c.index)
    if kind == "chat":
        yield [{**head, "choices": [protocol.chat_delta_choice(
            c.index, {"role": "assistant", "content": ""}, None, None, None)]} for c in ordered]
    elif any(c.echo for c in ordered):
        yield [{**head, "choices": [protocol.completion_choice(c.index, c.echo, None, None, None)]}
               for c in ordered if c.echo]
    keep_alive_s = generation.state.sse_keep_alive_s
    while not generation.done:
        try:
            # Cutting the wait loses nothing: outputs leave the queue only once it is over.
            async with asyncio.timeout(keep_alive_s):
                outputs = await generation.next_outputs()
        except TimeoutError:
            yield None
            continue
        usage = {"usage": generation.usage()} if continuous_usage else {}
        batch = [{**head, "choices": [delta], **usage} for choice, output in outputs
                 if output.text or output.logprobs or output.finished
                 for delta in _delta_choices(kind, choice, output, names)]
        if batch:
            yield batch


def _delta_choices(kind: Kind, choice: Choice, output: RequestOutput,
                   names: TokenText) -> list[dict[str, Any]]:
    """One choice entry per chunk; a chat with tools may need several (content, then calls),
    the finish on the last. The finish is the output's, not the choice's: outputs are taken in
    batches, and the choice has already recorded the batch's last one (an earlier output of the
    same batch must not carry its finish_reason)."""
    final = output.finished
    logprobs = None
    if output.logprobs is not None:
        logprobs = logprobs_body(kind, output.logprobs, names, choice.text_offset)  # advances it
    if kind == "completion":
        return [protocol.completion_choice(choice.index, output.text, logprobs,
                                           choice.finish_reason if final else None,
                                           choice.stop_reason if final else None)]
    text, deltas = output.text, []
    if choice.reasoning is not None:
        reasoning, text = choice.reasoning.feed(text, final=final)
        if reasoning and choice.reasoning_shown:
            deltas.append({"reasoning_content": reasoning, "reasoning": reasoning})  # vLLM's two names
    if choice.tool_reader is None:
        deltas += [{"content": text}] if text else []
    else:
        deltas += choice.tool_reader.feed(text, finished=final, cut=output.finish_reason == "length")
    if not deltas and (logprobs is not None or final):
        deltas = [{}]
    last = len(deltas) - 1
    return [protocol.chat_delta_choice(choice.index, delta, logprobs if i == 0 else None,
                                       choice.reported_finish_reason if final and i == last else None,
                                       choice.stop_reason if final and i == last else None)
            for i, delta in enumerate(deltas)]
