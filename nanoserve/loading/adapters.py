"""LoRA adapter files: a PEFT folder or llama.cpp's GGUF LoRA, read whole into checked weights.

Owns: `read_adapter`, which tells the two formats apart and reads either into
`model.lora.AdapterWeights` (each layer's A and B per PEFT module, in Hugging Face's row order,
and the scaling): PEFT's adapter_config.json + adapter_model.safetensors (scaling lora_alpha / r,
or / sqrt(r) with use_rslora), or a GGUF file with `general.type = adapter`, `adapter.type =
lora`, `adapter.lora.alpha` and a `blk.N.<tensor>.weight.lora_a` / `.lora_b` pair per target, as
llama.cpp's convert_lora_to_gguf.py writes them (scaling alpha / r, as llama.cpp applies it;
llama's Q and K rows of B un-permuted as its converter permuted them).
Refuses, by name and before anything is kept: a path that is neither, a rank above
max_lora_rank, a module the decoder has no LoRA support for, DoRA, trained biases and
modules_to_save, a GGUF written for another architecture's layout, and any tensor whose shape
does not fit the base model (`model.lora.check_weights`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nanoserve.config import ModelConfig
from nanoserve.errors import NanoserveError
from nanoserve.loading.gguf import dequantize_tensor, open_gguf, read_metadata, unpermute_qk
from nanoserve.model.lora import TARGETS, AdapterTensor, AdapterWeights, check_rank, check_weights, refuse

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# llama.cpp's tensor names for the PEFT modules a LoRA may target here.
_GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# llama.cpp writes these families as architecture "llama", whose Q and K rows its converter permutes.
_LLAMA_LAYOUT_FAMILIES = ("llama", "mistral", "mixtral")


def read_adapter(path: str, model: ModelConfig, max_rank: int) -> AdapterWeights:
    """The adapter at `path` (a PEFT folder or a GGUF LoRA file), checked against `model`."""
    location = Path(path)
    if location.is_dir():
        return _read_peft(location, path, model, max_rank)
    if location.is_file() and _starts_with(location, b"GGUF"):
        return _read_gguf(location, path, model, max_rank)
    raise refuse(path, f"is neither a PEFT adapter folder ({PEFT_CONFIG} and {PEFT_WEIGHTS}) nor a "
                       "GGUF LoRA file")


def _starts_with(file: Path, magic: bytes) -> bool:
    with file.open("rb") as handle:
        return handle.read(len(magic)) == magic


# -- PEFT ---------------------------------------------------------------------------------------

def _read_peft(folder: Path, path: str, model: ModelConfig, max_rank: int) -> AdapterWeights:
    config = _peft_config(folder, path, max_rank)
    rank = config["r"]
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return check_weights(path, model, rank, scaling, _peft_tensors(folder, path))


def _peft_config(folder: Path, path: str, max_rank: int) -> dict[str, Any]:
    config_file, weights_file = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise refuse(path, f"is not a PEFT adapter folder ({PEFT_CONFIG} and {PEFT_WEIGHTS})")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise refuse(path, f"{PEFT_CONFIG} is not JSON ({error})") from None
    if not isinstance(config, dict):
        raise refuse(path, f"{PEFT_CONFIG} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(path, f"peft_type {config.get('peft_type')!r} is not LORA")
    check_rank(path, config.get("r"), max_rank)
    unsupported = (("use_dora", (False, None)), ("bias", ("none", None)), ("modules_to_save", (None, [])))
    for key, allowed in unsupported:
        if config.get(key) not in allowed:
            raise refuse(path, f"{key}={config.get(key)!r} is not supported")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise refuse(path, f"target_modules {unknown} have no LoRA support here (supported: "
                           f"{', '.join(TARGETS)})")
    return config


def _peft_tensors(folder: Path, path: str) -> Iterator[AdapterTensor]:
    for key, tensor in load_file(str(folder / PEFT_WEIGHTS)).items():
        found = _PEFT_KEY.match(key)
        if found is None or found.group(2) not in TARGETS:
            raise refuse(path, f"tensor {key!r} is no LoRA A or B of a supported module")
        yield AdapterTensor(key, int(found.group(1)), found.group(2), found.group(3), tensor)


# -- GGUF ---------------------------------------------------------------------------------------

def _read_gguf(file: Path, path: str, model: ModelConfig, max_rank: int) -> AdapterWeights:
    try:
        reader = open_gguf(file)
    except NanoserveError as error:
        raise refuse(path, str(error)) from None
    meta = read_metadata(reader)
    for key, wanted in (("general.type", "adapter"), ("adapter.type", "lora")):
        if meta.get(key) != wanted:
            raise refuse(path, f"is a GGUF file whose {key} is {meta.get(key)!r}, not {wanted!r}: "
                               "no LoRA adapter")
    alpha = meta.get("adapter.lora.alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse(path, f"adapter.lora.alpha must be a number; got {alpha!r}")
    architecture = meta.get("general.architecture")
    permuted = architecture == "llama"
    if permuted != (model.family in _LLAMA_LAYOUT_FAMILIES):
        raise refuse(path, f"was written for GGUF architecture {architecture!r}; the base model is a "
                           f"{model.family}")
    tensors = [_gguf_tensor(path, tensor.name, dequantize_tensor(tensor)) for tensor in reader.tensors]
    ranks = [entry.tensor.shape[0] for entry in tensors if entry.which == "A"]
    if not ranks:
        raise refuse(path, "holds no lora_a tensor")
    rank = check_rank(path, ranks[0], max_rank)
    # llama.cpp scales by alpha / rank, and by 1 where the file gives alpha 0.
    scaling = alpha / rank if alpha else 1.0
    if permuted:
        tensors = [_unpermuted(entry, model) for entry in tensors]
    return check_weights(path, model, rank, scaling, tensors)


def _gguf_tensor(path: str, name: str, values: Any) -> AdapterTensor:
    found = _GGUF_KEY.match(name)
    if found is None or found.group(2) not in _GGUF_MODULES:
        raise refuse(path, f"tensor {name!r} is no lora_a or lora_b of a supported module (supported: "
                           f"{', '.join(_GGUF_MODULES)})")
    return AdapterTensor(name, int(found.group(1)), _GGUF_MODULES[found.group(2)], found.group(3).upper(),
                         torch.from_numpy(values))


def _unpermuted(entry: AdapterTensor, model: ModelConfig) -> AdapterTensor:
    """B of Q or K in Hugging Face's row order (the converter permuted its rows as the base
    model's); a B of the wrong shape is left for `check_weights` to refuse."""
    heads = {"q_proj": model.num_heads, "k_proj": model.num_kv_heads}.get(entry.module)
    if heads is None or entry.which != "B" or entry.tensor.shape[0] != heads * model.head_dim:
        return entry
    rows = unpermute_qk(entry.tensor.numpy(), heads)
    return AdapterTensor(entry.key, entry.layer, entry.module, entry.which, torch.from_numpy(rows.copy()))
