"""OpenAI's /v1/embeddings: the request model, its refusals, and the route.

Owns: `EmbeddingRequest` (OpenAI's fields: `input` as a string, a list of strings, token ids or
a list of token-id lists; `encoding_format` float or base64; `dimensions`, served only when it
is the model's hidden size; vLLM's `normalize`, `truncate_prompt_tokens`, `add_special_tokens`,
`priority`, and nanoserve's `cache_salt`), `EMBEDDINGS_REFUSED`, and the route: the same order
as a generation request (body checks, availability, the tenant's limit, encoding off the event
loop, admission), each input one embedding request of the engine, in the same batched steps as
generation (prefill only), under the tenant's cache scope and fair share.
Refuses: pooling itself (the engine's), and streaming (an embedding has one output).
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import struct
import time
from typing import Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from nanoserve.errors import InvalidRequestError
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams, keep_last_tokens
from nanoserve.server import planning
from nanoserve.server.errors import bad_request
from nanoserve.server.generation import (
    ClientDisconnectedError,
    Generation,
    check_capacity,
    until_done_or_disconnect,
)
from nanoserve.server.openai import routes
from nanoserve.server.openai.protocol import Int64, OpenAIModel, Refusal, TokenId, absent_or, empty_or_absent
from nanoserve.server.planning import PlannedSequence
from nanoserve.server.state import ServerState, state_of

EMBEDDINGS_REFUSED: dict[str, Refusal] = {
    # vLLM's
    "request_id": Refusal("request_id is not supported: responses carry the server's own id"),
    "embed_dtype": Refusal("embed_dtype is not supported: vectors are float32", absent_or("float32")),
    "endianness": Refusal("endianness is not supported: base64 vectors are little-endian float32",
                          absent_or("native", "little")),
    "messages": Refusal("embedding chat messages is not supported: send the text as input"),
    "mm_processor_kwargs": Refusal("multimodal inputs are not supported", empty_or_absent),
    "additional_data": Refusal("additional_data is not supported"),
    "use_activation": Refusal("use_activation applies to classification models, which are not served"),
}


class EmbeddingRequest(OpenAIModel):
    refused_fields: ClassVar[dict[str, Refusal]] = EMBEDDINGS_REFUSED

    model: str | None = None
    input: str | list[TokenId] | list[str] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description=(
        "Served only when it equals the model's hidden size (vectors are not truncated)."))
    user: str | None = Field(default=None, description="The end user's id; changes nothing computed.")
    normalize: bool | None = Field(default=None, description=(
        "vLLM's: scale each vector to unit L2 norm (default true, as OpenAI's vectors are)."))
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, description="Keep only the last N tokens.")
    add_special_tokens: bool = Field(default=True, description="Add the tokenizer's BOS to a text input.")
    priority: Int64 = Field(default=0, description="As for completions (--scheduling-policy priority).")
    cache_salt: str | None = Field(default=None, description=(
        "Requests share cached prompt blocks only with requests of the same salt (vLLM's)."))


async def create_embeddings(request: Request) -> Response:
    arrival_s = time.perf_counter()
    body = await routes.parse_body(request, EmbeddingRequest)
    generation = await run(request, body, arrival_s)
    if generation is None:
        return Response(status_code=499)  # nobody is listening; the sequences were aborted
    return JSONResponse(_response_body(generation, body))


async def run(request: Request, body: EmbeddingRequest, arrival_s: float) -> Generation | None:
    """Every input of `body` embedded, in the order of a generation request; None when the
    client hung up first (Ollama's /api/embed runs through here too)."""
    state = state_of(request)
    tenant = routes.tenant_of(request)
    planning.check_model(state, body.model)
    routes.check_available(state)
    routes.check_tenant_room(state, tenant)
    plan = await asyncio.to_thread(_plan, state, body)
    check_capacity(state, len(plan))
    routes.check_tenant_room(state, tenant)
    request_id = f"embd-{secrets.token_hex(12)}"
    generation = Generation.start(state, plan, arrival_s, request_id=request_id, tenant=tenant)
    try:
        await until_done_or_disconnect(request, generation)
    except ClientDisconnectedError:
        return None
    finally:
        generation.close()
    return generation


def _plan(state: ServerState, body: EmbeddingRequest) -> list[PlannedSequence]:
    """One embedding sequence per input, each checked and encoded (400 naming the input)."""
    inputs = _inputs(body.input)
    if len(inputs) > state.limits.max_prompts:
        raise bad_request(f"at most {state.limits.max_prompts} inputs per request; got {len(inputs)}",
                          "input")
    admission = state.admission
    try:
        pooling = PoolingParams(normalize=body.normalize is not False, dimensions=body.dimensions)
        admission.check_pooling(pooling)
        params = SamplingParams(max_tokens=1, priority=body.priority, cache_salt=body.cache_salt)
    except InvalidRequestError as error:
        raise bad_request(error.message, error.param) from None
    plan = []
    for i, item in enumerate(inputs):
        param = "input" if isinstance(body.input, str) or _is_token_ids(body.input) else f"input[{i}]"
        if isinstance(item, str) and not body.add_special_tokens:
            item = admission.tokenizer.encode(item, add_bos=False) or item  # "": refused as empty below
        try:
            ids = keep_last_tokens(admission.encode_prompt(item), body.truncate_prompt_tokens)
            admission.check_fits(len(ids), params.max_tokens)
        except InvalidRequestError as error:
            raise bad_request(error.message, param) from None
        plan.append(PlannedSequence(i, i, ids, params, pooling=pooling))
    return plan


def _inputs(value: str | list) -> list[str | list[int]]:
    if isinstance(value, str) or _is_token_ids(value):
        return [value]
    if not value:
        raise bad_request("input is empty: give a string, a list of token ids or a list of them", "input")
    return list(value)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, int) for item in value)


def _response_body(generation: Generation, body: EmbeddingRequest) -> dict[str, Any]:
    ordered = sorted(generation.choices.values(), key=lambda choice: choice.index)
    prompt_tokens = sum(choice.num_prompt_tokens for choice in ordered)
    data = [{"object": "embedding", "index": choice.index,
             "embedding": _encoded(choice.embedding, body.encoding_format)} for choice in ordered]
    return {"id": generation.request_id, "object": "list", "created": int(time.time()),
            "model": body.model or generation.state.model_names[0], "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the vector's little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
