"""Ollama's model routes' bodies: /api/tags, /api/show, /api/ps and /api/version, in Ollama's
shapes (its api/types.go: ListResponse, ShowResponse, ProcessResponse).

Owns: finding the served model an Ollama request names (`find`: its served name or an alias,
with or without Ollama's default tag ":latest"; a LoRA adapter of a one-model server; any other
name is Ollama's 404, `model 'x' not found`), and what a served model looks like to an Ollama
client, loaded or not (`Described`: a loaded model read from its engine, one not loaded from
its configuration and tokenizer files, never its weights): its details (format, family,
parameter size estimated from the configuration, quantization), its model_info keys in GGUF's
naming (`<family>.context_length`, ...), its capabilities, the files' size, time and a digest
of their identity (path, size, time: not of their content, which would mean reading every
byte), and while loaded when it unloads (`expires_at`, the registry's idle deadline).
Refuses: pulling, copying, creating or deleting models (Ollama's other /api routes answer 404
as any unknown path does): the served models are the ones `nanoserve serve` was given.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.errors import InvalidRequestError, NanoserveError
from nanoserve.loading.default_model import ModelSource, resolve_model
from nanoserve.loading.weights import read_config
from nanoserve.server.bridges.models import ServedModel
from nanoserve.server.errors import APIError
from nanoserve.server.state import ServerState, unavailable
from nanoserve.tokenizer import Tokenizer
from nanoserve.worker.startup import max_model_len

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig, ModelConfig
    from nanoserve.engine.core import Engine

log = logging.getLogger("nanoserve.server")

DEFAULT_TAG = ":latest"
# Ollama's expires_at for a model that never unloads (keep_alive -1): now + Go's longest duration.
NEVER_S = (2**63 - 1) / 1e9


def not_found(name: str) -> APIError:
    return APIError(404, f"model '{name}' not found", param="model", code="model_not_found")


def find(state: ServerState, name: str | None) -> tuple[ServedModel, str]:
    """The served model an Ollama request names, and the name to serve it under (the name
    without ":latest": a served name, an alias, or a one-model server's LoRA adapter); a 404 in
    Ollama's words for any other. `state`: the server's, before any model is bound."""
    if not name:
        raise APIError(400, "model is required", param="model")
    bare = name.removesuffix(DEFAULT_TAG)
    model = state.models.named(bare)
    if model is None and bare in state.adapters.served:
        model = state.models.only
    if model is None:
        raise not_found(name)
    return model, bare


def timestamp(when: dt.datetime | None = None) -> str:
    """RFC 3339 in UTC, as Go writes a time.Time (Ollama's created_at, modified_at)."""
    when = when or dt.datetime.now(dt.UTC)
    return when.isoformat().replace("+00:00", "Z")


# -- one model, loaded or not ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Described:
    """What Ollama's routes say about one served model."""

    config: EngineConfig  # how it is served: its dtype, quantization, task
    model_config: ModelConfig
    context_length: int
    source: ModelSource  # its files: the GGUF file, or the checkpoint folder
    engine: Engine | None  # while loaded

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (read from its files when it is not loaded)."""
        return self.engine.tokenizer if self.engine is not None else Tokenizer.from_dir(self.source.dir)


def loaded_engine(model: ServedModel) -> Engine | None:
    """The model's engine while it is loaded. Read on the event loop: an unload takes it away."""
    bridge = model.bridge
    return bridge.engine if bridge is not None and model.status == "loaded" else None


def reading(state: ServerState, model: ServedModel) -> tuple[Engine | None, EngineConfig | None]:
    """On the event loop: where `describe` reads `model` from (its engine, else its configuration);
    a 503 for a model the server knows only by its engine (a one-model server's) until it has loaded."""
    engine = loaded_engine(model)
    if engine is None and model.spec.config is None:
        raise unavailable(f"the model '{model.name}' is described once it has loaded"
                          + ("; it is loading" if model.status == "loading" else ""), state.limits)
    return engine, model.spec.config


def describe(name: str, engine: Engine | None, config: EngineConfig | None) -> Described:
    """`name`'s description from its engine, or (off the event loop: it reads files) from the
    configuration and tokenizer its engine would be built from; a 503 naming why its files do
    not read."""
    if engine is not None:
        return Described(engine.config, engine.model_config, engine.max_model_len, engine.source, engine)
    try:
        source = resolve_model(config.model, float_weights=False)  # a GGUF's config and tokenizer only
        model_config = read_config(source.dir)
    except NanoserveError as error:
        raise APIError(503, f"the model '{name}' cannot be read: {error}", param="model",
                       code="service_unavailable") from None
    return Described(config, model_config, max_model_len(config, model_config), source, None)


def _files(model: Described) -> tuple[int, dt.datetime, str, str]:
    """The model's size in bytes, modification time, digest of identity, and format."""
    path = model.source.gguf or model.source.dir
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    size = sum(p.stat().st_size for p in files)
    mtime = max((p.stat().st_mtime for p in files), default=0.0)
    identity = f"{path.resolve()}\0{size}\0{mtime}".encode()
    form = "gguf" if model.source.gguf is not None else "safetensors"
    digest = "sha256:" + hashlib.sha256(identity).hexdigest()
    return size, dt.datetime.fromtimestamp(mtime, dt.UTC), digest, form


def parameter_count(config: ModelConfig) -> int:
    """The weights' count from the configuration (norms left out): embeddings, the head unless
    tied, and per layer attention and the MLP (every expert's)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    experts = getattr(config.experts, "num_experts", 1) if config.experts is not None else 1
    mlp = 3 * hidden * config.intermediate_size * experts
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_layers * (attention + mlp)


def _size_label(count: int) -> str:
    """Ollama's parameter_size: "494.03M", "8.0B"."""
    if count >= 10**9:
        return f"{count / 1e9:.1f}B"
    return f"{count / 1e6:.2f}M"


def details(model: Described) -> dict[str, Any]:
    family = model.model_config.family
    quantization = (model.config.quantize or str(model.config.dtype or "auto")).upper()
    return {"parent_model": "", "format": _files(model)[3], "family": family, "families": [family],
            "parameter_size": _size_label(parameter_count(model.model_config)),
            "quantization_level": quantization}


def _entry(model: Described, name: str) -> dict[str, Any]:
    size, modified, digest, _ = _files(model)
    return {"name": name + DEFAULT_TAG, "model": name + DEFAULT_TAG, "size": size, "digest": digest,
            "details": details(model), "modified_at": timestamp(modified)}


# -- the bodies -----------------------------------------------------------------------------------

Listed = tuple[ServedModel, "Engine | None", "EngineConfig | None"]


def listing(state: ServerState, *, loaded_only: bool) -> list[Listed]:
    """On the event loop: every served model (or only the loaded ones) and where to read it from."""
    return [(model, *reading(state, model)) for model in state.models.models.values()
            if not loaded_only or loaded_engine(model) is not None]


def tags_body(listed: list[Listed]) -> dict[str, Any]:
    """Every served model under each of its listed names. Off the event loop: reads files; a
    model whose files do not read is left out (logged): its requests say why."""
    entries = []
    for model, engine, config in listed:
        try:
            described = describe(model.name, engine, config)
        except APIError as error:
            log.warning("/api/tags leaves out %r: %s", model.name, error.message)
            continue
        entries += [_entry(described, name) for name in model.spec.names]
    return {"models": entries}


def ps_body(listed: list[Listed], unloads_in_s: dict[str, float]) -> dict[str, Any]:
    """The loaded models, each with when it unloads if no request comes (`unloads_in_s`, the
    registry's, by model; inf: never)."""
    now = dt.datetime.now(dt.UTC)
    models = []
    for model, engine, _ in listed:
        described = describe(model.name, engine, None)
        on_device = str(engine.device).startswith("cuda")
        expires = now + dt.timedelta(seconds=min(unloads_in_s[model.name], NEVER_S))
        for name in model.spec.names:
            entry = _entry(described, name)
            del entry["modified_at"]
            models.append({**entry, "expires_at": timestamp(expires),
                           "size_vram": entry["size"] if on_device else 0,
                           "context_length": described.context_length})
    return {"models": models}


def unloads_in(state: ServerState, listed: list[Listed]) -> dict[str, float]:
    """On the event loop: the seconds each listed model stays loaded if no request comes."""
    return {model.name: state.models.unloads_in_s(model) for model, _, _ in listed}


def capabilities(state: ServerState, model: Described, tokenizer: Tokenizer) -> list[str]:
    if model.config.task == "embed":
        return ["embedding"]
    found = ["completion"]
    if "tools" in (tokenizer.chat_template or ""):
        found.append("tools")
    try:
        thinks = state.reasoning.tags(tokenizer) is not None
    except InvalidRequestError:  # --reasoning-parser names tags this model lacks: it would not load
        thinks = False
    if thinks:
        found.append("thinking")
    return found


def show_body(state: ServerState, name: str, model: Described) -> dict[str, Any]:
    """Off the event loop when `model` is not loaded: reads its tokenizer."""
    config = model.model_config
    family = config.family
    tokenizer = model.tokenizer()
    _, modified, _, _ = _files(model)
    info = {"general.architecture": family, "general.parameter_count": parameter_count(config),
            f"{family}.context_length": model.context_length,
            f"{family}.embedding_length": config.hidden_size, f"{family}.block_count": config.num_layers,
            f"{family}.attention.head_count": config.num_heads,
            f"{family}.attention.head_count_kv": config.num_kv_heads,
            f"{family}.feed_forward_length": config.intermediate_size,
            f"{family}.vocab_size": config.vocab_size}
    source = model.source.gguf or model.source.dir
    return {"modelfile": f"# served by nanoserve as {name}\nFROM {source}\n", "parameters": "",
            "template": tokenizer.chat_template or "", "details": details(model), "model_info": info,
            "capabilities": capabilities(state, model, tokenizer), "modified_at": timestamp(modified)}


def version_body() -> dict[str, str]:
    from nanoserve import __version__

    return {"version": __version__}
