"""vLLM's runtime adapter routes: `POST /v1/load_lora_adapter` (`lora_name`, `lora_path`) and
`POST /v1/unload_lora_adapter` (`lora_name`).

Owns: both routes, which answer 404 unless the server runs with --enable-lora-runtime-updates
(loading files a client names is a privilege), and run the engine's `add_lora` / `remove_lora`
on its thread between steps. Unloading takes the name off the registry at once; requests
running with the adapter finish with it.
Refuses, 400 naming the field and with nothing loaded: a name that is the base model's or is
served already, and every adapter the engine refuses (not an adapter, a rank above
--max-lora-rank, a module the model lacks, more than --max-loras); an unknown name to unload: 404.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from fastapi import Request
from fastapi.responses import PlainTextResponse

from nanoserve.errors import InvalidRequestError
from nanoserve.server.bridges.engine_bridge import EngineUnavailableError
from nanoserve.server.errors import APIError, bad_request
from nanoserve.server.openai.protocol import OpenAIModel, Refusal, absent_or
from nanoserve.server.openai.routes import parse_body
from nanoserve.server.state import ServerState, state_of, unavailable

if TYPE_CHECKING:
    from nanoserve.engine.core import Engine

RUNTIME_UPDATES_FLAG = "--enable-lora-runtime-updates"


class LoadLoRAAdapterRequest(OpenAIModel):
    refused_fields: ClassVar[dict[str, Refusal]] = {"load_inplace": Refusal(
        "load_inplace is not supported: unload the adapter, then load it again", absent_or(False))}
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    refused_fields: ClassVar[dict[str, Refusal]] = {"lora_int_id": Refusal(
        "lora_int_id is not supported: name the adapter by lora_name")}
    lora_name: str


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = _runtime_updates(request)
    body = await parse_body(request, LoadLoRAAdapterRequest)
    registry = state.adapters
    try:
        lora = registry.reserve(body.lora_name, body.lora_path)
    except InvalidRequestError as error:
        raise bad_request(error.message, error.param) from None
    try:
        # `loaded` runs on the event loop once the engine has the adapter, even if this
        # request's client has gone meanwhile: a resident adapter is always a routable one.
        await _on_engine(state, lambda engine: engine.add_lora(lora), then=lambda _: registry.loaded(lora))
    finally:
        registry.release(lora.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = _runtime_updates(request)
    body = await parse_body(request, UnloadLoRAAdapterRequest)
    if state.adapters.remove(body.lora_name) is None:
        raise APIError(404, f"the LoRA adapter {body.lora_name!r} cannot be found", param="lora_name",
                       code="not_found")
    await _on_engine(state, lambda engine: engine.remove_lora(body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _runtime_updates(request: Request) -> ServerState:
    state = state_of(request)
    if not state.adapters.runtime_updates:
        raise APIError(404, f"loading and unloading LoRA adapters at run time is off: start the server "
                            f"with {RUNTIME_UPDATES_FLAG}", code="not_found")
    return state


async def _on_engine(state: ServerState, run: Callable[[Engine], object], *,
                     then: Callable[[object], None] | None = None) -> object:
    """`run(engine)` on the engine thread; its refusal as a 400, an engine gone as a 503."""
    try:
        return await state.async_engine.call(run, then=then)
    except InvalidRequestError as error:
        raise bad_request(error.message, error.param) from None
    except EngineUnavailableError as error:
        raise unavailable(str(error), state.limits) from None

