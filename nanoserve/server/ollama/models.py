"""Ollama's model routes: /api/tags, /api/show, /api/ps and /api/version, in Ollama's shapes
(its api/types.go: ListResponse, ShowResponse, ProcessResponse).

Owns: what a served model looks like to an Ollama client: its names (`served_name`: the
served name, or it with Ollama's default tag ":latest", as /api/tags lists it), its details
(format, family, parameter size estimated from the configuration, quantization), its
model_info keys in GGUF's naming (`<family>.context_length`, ...), its capabilities, and the
files' size, time and a digest of their identity (path, size, time: not of their content,
which would mean reading every byte).
Refuses: loading, pulling, copying, creating or deleting models (Ollama's other /api routes
answer 404 as any unknown path does): a served model is the one `nanoserve serve` loaded.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanoserve.server.errors import APIError
from nanoserve.server.state import ServerState

if TYPE_CHECKING:
    from nanoserve.config import ModelConfig

DEFAULT_TAG = ":latest"
# Ollama's expires_at for a model that never unloads (keep_alive -1): now + Go's longest duration.
NEVER_S = (2**63 - 1) / 1e9


def not_found(name: str) -> APIError:
    return APIError(404, f'model "{name}" not found', param="model", code="model_not_found")


def served_name(state: ServerState, name: str | None) -> str:
    """The served model (or LoRA adapter) an Ollama request names; a 404 for any other."""
    if not name:
        raise APIError(400, "model is required", param="model")
    bare = name.removesuffix(DEFAULT_TAG)
    if bare in state.accepted_names or bare in state.adapters.served:
        return bare
    raise not_found(name)


def timestamp(when: dt.datetime | None = None) -> str:
    """RFC 3339 in UTC, as Go writes a time.Time (Ollama's created_at, modified_at)."""
    when = when or dt.datetime.now(dt.UTC)
    return when.isoformat().replace("+00:00", "Z")


def _files(state: ServerState) -> tuple[int, dt.datetime, str, str]:
    """The model's size in bytes, modification time, digest of identity, and format."""
    path = Path(state.engine.config.model or "")
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path] if path.is_file() else []
    size = sum(p.stat().st_size for p in files)
    mtime = max((p.stat().st_mtime for p in files), default=0.0)
    identity = f"{path.resolve()}\0{size}\0{mtime}".encode()
    form = "gguf" if path.suffix == ".gguf" else "safetensors"
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


def details(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    config = engine.model_config
    quantization = (engine.config.quantize or str(engine.config.dtype or "auto")).upper()
    return {"parent_model": "", "format": _files(state)[3], "family": config.family,
            "families": [config.family], "parameter_size": _size_label(parameter_count(config)),
            "quantization_level": quantization}


def _entry(state: ServerState, name: str) -> dict[str, Any]:
    size, modified, digest, _ = _files(state)
    return {"name": name + DEFAULT_TAG, "model": name + DEFAULT_TAG, "size": size, "digest": digest,
            "details": details(state), "modified_at": timestamp(modified)}


def tags_body(state: ServerState) -> dict[str, Any]:
    return {"models": [_entry(state, name) for name in state.model_names]}


def ps_body(state: ServerState) -> dict[str, Any]:
    expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=NEVER_S)
    on_device = str(getattr(state.engine, "device", "cpu")).startswith("cuda")
    models = []
    for name in state.model_names:
        entry = _entry(state, name)
        del entry["modified_at"]
        models.append({**entry, "expires_at": timestamp(expires),
                       "size_vram": entry["size"] if on_device else 0,
                       "context_length": state.engine.max_model_len})
    return {"models": models}


def capabilities(state: ServerState) -> list[str]:
    engine = state.engine
    if engine.config.task == "embed":
        return ["embedding"]
    found = ["completion"]
    template = engine.tokenizer.chat_template or ""
    if "tools" in template:
        found.append("tools")
    if state.reasoning.tags(engine.tokenizer) is not None:
        found.append("thinking")
    return found


def show_body(state: ServerState, name: str) -> dict[str, Any]:
    engine = state.engine
    config = engine.model_config
    family = config.family
    _, modified, _, _ = _files(state)
    info = {"general.architecture": family, "general.parameter_count": parameter_count(config),
            f"{family}.context_length": engine.max_model_len,
            f"{family}.embedding_length": config.hidden_size, f"{family}.block_count": config.num_layers,
            f"{family}.attention.head_count": config.num_heads,
            f"{family}.attention.head_count_kv": config.num_kv_heads,
            f"{family}.feed_forward_length": config.intermediate_size,
            f"{family}.vocab_size": config.vocab_size}
    return {"modelfile": f"# served by nanoserve as {name}\nFROM {engine.config.model}\n", "parameters": "",
            "template": engine.tokenizer.chat_template or "", "details": details(state), "model_info": info,
            "capabilities": capabilities(state), "modified_at": timestamp(modified)}


def version_body() -> dict[str, str]:
    from nanoserve import __version__

    return {"version": __version__}
