"""The LoRA adapters a server routes to, as vLLM serves them: a request picks one by `model`.

Owns: `LoRAModule` (one `serve --lora-modules` entry, vLLM's `name=path` or its JSON form
`{"name", "path", "base_model_name"}`, `parse_lora_module`) and `AdapterRegistry`, the adapters
requests may name (event loop only), their ids and their /v1/models cards (`root` the path,
`parent` the base model). An adapter leaves the registry the moment it is unloaded; requests
already running with it keep its weights (their engine request holds them) until they finish.
Refuses: a name that is the base model's or is taken already, a name given twice at start
(`lora_modules`), a `model` no longer served (404); the runtime routes are `adapter_routes`'.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoserve.errors import InvalidRequestError
from nanoserve.model.lora import LoRARequest
from nanoserve.server.errors import APIError

if TYPE_CHECKING:
    from nanoserve.engine.core import Engine

@dataclass(frozen=True, slots=True)
class LoRAModule:
    """An adapter the server loads at start: its name for clients, its path, and the base model
    /v1/models lists as its parent (None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """vLLM's `name=path`, or its JSON `{"name": ..., "path": ..., "base_model_name": ...}`;
    a ValueError saying what is wrong otherwise."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{text!r} is not JSON ({error.msg})") from None
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"{text!r} has keys {unknown}; an entry has name, path and base_model_name")
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"{text!r}: base_model_name must be a string")
    else:
        name, _, path = text.partition("=")
        base = None
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"{text!r} is not name=path (or a JSON object with name and path)")
    return LoRAModule(name.strip(), path.strip(), base)


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    lora: LoRARequest
    parent: str


@dataclass(slots=True)
class AdapterRegistry:
    """The adapters requests may name, by name. `load_at_start` runs on the engine thread
    before the server is ready; everything else on the event loop."""

    base_names: frozenset[str]  # the served model's names and aliases: no adapter may take one
    parent: str  # the served model's listed name
    at_start: tuple[LoRAModule, ...] = ()
    runtime_updates: bool = False
    served: dict[str, ServedAdapter] = field(default_factory=dict)
    _loading: set[str] = field(default_factory=set)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        names = [module.name for module in self.at_start]
        for name in names:
            self.check_name(name, param="lora_modules")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise InvalidRequestError(f"adapter names {repeated} are given more than once",
                                      param="lora_modules")

    def check_name(self, name: str, *, param: str) -> None:
        if name in self.base_names:
            raise InvalidRequestError(f"the adapter name {name!r} is the base model's name", param=param)
        if name in self.served or name in self._loading:
            raise InvalidRequestError(f"the LoRA adapter {name!r} has already been loaded", param=param)

    def reserve(self, name: str, path: str) -> LoRARequest:
        """A new adapter's request, its name held until `loaded` or `release` (runtime loads)."""
        self.check_name(name, param="lora_name")
        self._loading.add(name)
        return LoRARequest(name, next(self._ids), path)

    def loaded(self, lora: LoRARequest) -> None:
        self._loading.discard(lora.lora_name)
        self.served[lora.lora_name] = ServedAdapter(lora, self.parent)

    def release(self, name: str) -> None:
        self._loading.discard(name)

    def remove(self, name: str) -> ServedAdapter | None:
        """Stop routing to `name` (None: it was not served)."""
        return self.served.pop(name, None)

    def load_at_start(self, engine: Engine) -> None:
        """Load the --lora-modules adapters into `engine` (the engine thread, before any request)."""
        for module in self.at_start:
            lora = LoRARequest(module.name, next(self._ids), module.path)
            engine.add_lora(lora)
            self.served[module.name] = ServedAdapter(lora, module.base_model_name or self.parent)

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names; None for the base model (a name neither serves: 404)."""
        if model is None or model in self.base_names:
            return None
        served = self.served.get(model)
        if served is None:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.parent!r}"
                                + (f" and the LoRA adapters {sorted(self.served)}" if self.served else ""),
                           param="model", code="model_not_found")
        return served.lora

    def cards(self, created: int, max_model_len: int | None) -> list[dict[str, Any]]:
        """vLLM's /v1/models entries of the adapters."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "nanoserve",
                 "root": served.lora.lora_path, "parent": served.parent, "max_model_len": max_model_len}
                for name, served in self.served.items()]
