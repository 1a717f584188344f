"""Loading a Hugging Face style checkpoint directory into a `DecoderLM`.

Reads config.json and one or sharded safetensors files. GGUF files and the default model are
first converted into such a directory (`loading.gguf`, `loading.default_model`), so this is the one
place weights enter the engine, and the one place config.json is read: `load_weights` returns
the `ModelConfig` beside the weights. A GGUF run in its own quantization reads its tensors
from the file instead (`gguf=`): the matrices stay GGUF blocks (nanoserve.quant).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nanoserve.config import ModelConfig
from nanoserve.distributed.shards import (
    SPLIT_BY_OUTPUT,
    Shard,
    local_config,
    mlp_width,
    shard_of,
    shard_tensor,
)
from nanoserve.errors import ModelNotFoundError, UnsupportedModelError
from nanoserve.loading.gguf import gguf_weights
from nanoserve.loading.hf_config import family_of, read_model_config
from nanoserve.loading.hf_names import hf_tensor_shapes, weights_from_hf
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.linear import LinearKernel
from nanoserve.model.vision_config import text_config_dict
from nanoserve.model.weights import LlamaWeights


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    raw = text_config_dict(json.loads(path.read_text()))
    try:
        family_of(raw)
        return read_model_config(raw)
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"{model_dir}: {error}") from None


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ModelNotFoundError(f"{model_dir} has no .safetensors weights")
    return found


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        tensors.update(load_file(str(path)))
    return tensors


def with_model_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors under the causal-LM names: a base-model checkpoint (`Qwen3Model`, as embedding
    models are saved) names them without the `model.` prefix."""
    if "embed_tokens.weight" not in tensors or "model.embed_tokens.weight" in tensors:
        return tensors
    return {f"model.{name}": tensor for name, tensor in tensors.items()}


# A vision-language checkpoint's text model, under the prefixes its families save it with
# (Idefics3 / SmolVLM's; LLaVA's as transformers 5 writes and reads it, and as older saves do).
_TEXT_MODEL_PREFIXES = (("model.text_model.", "model."), ("model.language_model.", "model."),
                        ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))


def text_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language checkpoint's text model under a causal LM's names (`model.layers...`,
    `lm_head.weight`), its vision tensors left out; any other checkpoint's tensors as they are."""
    if not any(name.startswith(old) for name in tensors for old, _ in _TEXT_MODEL_PREFIXES):
        return tensors
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in _TEXT_MODEL_PREFIXES:
            if name.startswith(old):
                renamed[new + name[len(old):]] = tensor
                break
        else:
            if name.startswith("lm_head."):
                renamed[name] = tensor
    return renamed


def load_shard_state_dict(model_dir: Path, config: ModelConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """Rank `shard`'s part of every tensor, read as safetensors slices: no rank reads the rest."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as file:
            for name in file.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                def read(dim: int | None, ranges: list[tuple[int, int]], name: str = name) -> torch.Tensor:
                    if dim is None:
                        return file.get_tensor(name)
                    part = file.get_slice(name)
                    pieces = [part[a:b] if dim == 0 else part[:, a:b] for a, b in ranges]
                    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]
                tensors[name] = shard_tensor(name, read, config, shard)
    return tensors


def load_weights(model_dir: Path, *, dtype: torch.dtype, device: torch.device, gguf: Path | None = None,
                 log_line: Callable[[str], None] | None = None,
                 shard: Shard | None = None) -> tuple[ModelConfig, LlamaWeights]:
    """`gguf`: read the tensors from that file as they are (blocks stay blocks); `model_dir`
    then only supplies config.json. `log_line` hears what the GGUF path dequantized, and why.
    `shard`: only that rank's part of every tensor (nanoserve.distributed.shards); the config returned
    is still the whole model's."""
    config = read_config(model_dir)
    world = shard.world if shard is not None else 1
    if gguf is not None:
        raw = json.loads((model_dir / "config.json").read_text())
        keep = shard_of(config, shard) if shard is not None else None
        tensors = gguf_weights(gguf, raw, log_line, keep=keep)
    elif shard is not None:
        tensors = load_shard_state_dict(model_dir, config, shard)
    else:
        tensors = text_tensors(with_model_prefix(load_state_dict(model_dir)))
    check_tensors(model_dir, config, tensors, shard)
    weights = weights_from_hf(local_config(config, world), tensors).to(dtype, device)
    if gguf is not None:
        del tensors
        release_freed_memory()
    return config, weights


def local_shapes(config: ModelConfig, shard: Shard) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor rank `shard` holds (`hf_tensor_shapes` of its `local_config`)."""
    shapes = hf_tensor_shapes(local_config(config, shard.world))
    if shard.by_output:
        rows = config.hidden_size // shard.world
        for name in shapes:
            if name.endswith(SPLIT_BY_OUTPUT):
                full = config.num_heads * config.head_dim if "o_proj" in name else mlp_width(name, config)
                shapes[name] = (rows, full)
    return shapes


def check_tensors(model_dir: Path, config: ModelConfig, tensors: dict, shard: Shard | None = None) -> None:
    """Every tensor the architecture needs is there in its shape (rank `shard`'s part of it);
    refused naming it otherwise (before any is converted). Extra tensors (rotary caches some
    exporters add) are ignored."""
    expected = hf_tensor_shapes(config) if shard is None else local_shapes(config, shard)
    missing = [name for name in expected if name not in tensors]
    if missing:
        shown = ", ".join(f"{name} {expected[name]}" for name in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise UnsupportedModelError(f"{model_dir}: the checkpoint lacks tensors a {config.family} model with "
                                    f"this config.json needs: {shown}{more}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise UnsupportedModelError(f"{model_dir}: tensor {name} has shape {tuple(tensors[name].shape)}; "
                                        f"config.json implies {shape}")


def release_freed_memory() -> None:
    """Hand the heap pages freed after a load (the q/k/v and gate/up parts copied into their
    stacks, the GGUF reader's metadata) back to the OS, so they leave the resident set; glibc
    keeps them otherwise. A no-op where there is no glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def load_llama(model_dir: Path, *, dtype: torch.dtype, device: torch.device,
               batch_invariant: bool = False, linear_kernel: LinearKernel | None = None,
               max_positions: int | None = None) -> DecoderLM:
    config, weights = load_weights(model_dir, dtype=dtype, device=device)
    return DecoderLM(config, weights, batch_invariant=batch_invariant, linear_kernel=linear_kernel,
                     max_positions=max_positions)
