"""llama.cpp's `mmproj` GGUF files: a vision tower and projector beside a text GGUF (`--mmproj`).

Owns: reading an mmproj file's `clip.*` metadata into a `VisionConfig` and the processor fields
the family's processor reads (tile size, the longest edge images are first resized to, mean and
std), and its `v.*` / `mm.*` tensors, under llama.cpp's names (gguf-py's tensor map), into the
Hugging Face names `loading.vision` builds the encoder from, so one builder serves both paths;
and each family's image token in the text model's vocabulary (`IMAGE_TOKENS`). Gemma 3's
pooling is its `projector.scale_factor` (llama.cpp's default 4 where the file leaves it out),
and its soft-token norm is stored as 1 + w (its converter adds the one).
Refuses: a projector type other than those listed in `PROJECTORS`, and a file without a vision
encoder, naming the file and the field.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from nanoserve.errors import UnsupportedModelError
from nanoserve.loading.vision import check_vision_tensors, vision_weights
from nanoserve.model.vision import VisionWeights
from nanoserve.model.vision_config import VisionConfig

# llama.cpp's projector type -> the vision family that runs it
PROJECTORS = {"idefics3": "idefics3", "gemma3": "gemma3"}
# The token each family's image rows replace, as the text model's vocabulary spells it.
IMAGE_TOKENS = {"idefics3": "<image>", "gemma3": "<image_soft_token>"}
# Each family's Hugging Face tower prefix and projector names (loading.vision's NAMES).
_TOWERS = {"idefics3": "model.vision_model.", "gemma3": "vision_tower."}
_PROJECTOR_NAMES = {"mm.model.fc": "model.connector.modality_projection.proj",
                    "mm.input_projection": "multi_modal_projector.mm_input_projection",
                    "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm"}
GEMMA3_SCALE_FACTOR_DEFAULT = 4  # clip.cpp's pooling kernel for gemma3 when the file names none
# Per-layer names: llama.cpp's (v.blk.N.<name>) -> Hugging Face's (encoder.layers.N.<name>)
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_TOWER_NAMES = {"v.patch_embd": "embeddings.patch_embedding",
                "v.position_embd": "embeddings.position_embedding", "v.post_ln": "post_layernorm"}
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def read_mmproj(path: Path, token_id: Callable[[str], int | None]) -> tuple[VisionConfig, VisionWeights,
                                                                           dict[str, Any]]:
    """The tower's config (`token_id`: the text model's vocabulary, where its family's image
    token is looked up), its float32 weights, and the processor fields its metadata gives
    (preprocessor_config.json's names)."""
    reader = GGUFReader(str(path))
    meta = {field.name: field.contents() for field in reader.fields.values()}
    projector = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if not meta.get("clip.has_vision_encoder", projector is not None):
        raise UnsupportedModelError(f"{path}: the mmproj file has no vision encoder "
                                    "(clip.has_vision_encoder)")
    if projector not in PROJECTORS:
        raise UnsupportedModelError(f"{path}: clip.projector_type {projector!r} is not supported; nanoserve "
                                    f"runs {', '.join(PROJECTORS)}")
    family = PROJECTORS[projector]
    image_token_id = token_id(IMAGE_TOKENS[family])
    if image_token_id is None:
        raise UnsupportedModelError(f"the text model's vocabulary has no {IMAGE_TOKENS[family]} token for "
                                    f"{path.name}'s images")
    config = _config(path, meta, family, image_token_id)
    tensors = {_hf_name(tensor.name, _TOWERS[family]): _float32(tensor) for tensor in reader.tensors}
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    if norm in tensors:  # llama.cpp's converter stores Gemma's (1 + w): back to transformers' w
        tensors[norm] = tensors[norm] - 1.0
    check_vision_tensors(path, config, tensors)
    return config, vision_weights(config, tensors), _processor_fields(meta, config)


def _config(path: Path, meta: dict[str, Any], family: str, image_token_id: int) -> VisionConfig:
    def need(key: str) -> Any:
        if key not in meta:
            raise UnsupportedModelError(f"{path}: the mmproj file lacks the metadata {key}")
        return meta[key]

    v = "clip.vision."
    shape = dict(family=family, hidden_size=need(v + "embedding_length"),
                 intermediate_size=need(v + "feed_forward_length"), num_layers=need(v + "block_count"),
                 num_heads=need(v + "attention.head_count"), num_channels=3,
                 image_size=need(v + "image_size"), patch_size=need(v + "patch_size"),
                 layer_norm_eps=meta.get(v + "attention.layer_norm_epsilon", 1e-6),
                 hidden_act="gelu_pytorch_tanh", text_hidden_size=need(v + "projection_dim"),
                 image_token_id=image_token_id)
    if family == "idefics3":
        return VisionConfig(**shape, scale_factor=meta.get(v + "projector.scale_factor", 1))
    kernel = meta.get(v + "projector.scale_factor", GEMMA3_SCALE_FACTOR_DEFAULT)
    grid = shape["image_size"] // shape["patch_size"]
    if kernel < 1 or grid % kernel:
        raise UnsupportedModelError(f"{path}: clip.vision.projector.scale_factor {kernel} does not divide "
                                    f"the {grid} x {grid} patch grid")
    return VisionConfig(**shape, tokens_per_image=(grid // kernel) ** 2, bidirectional=True)


def _processor_fields(meta: dict[str, Any], config: VisionConfig) -> dict[str, Any]:
    if config.family == "gemma3":
        fields: dict[str, Any] = {"size": {"height": config.image_size, "width": config.image_size}}
    else:
        fields = {"max_image_size": {"longest_edge": config.image_size},
                  "size": {"longest_edge": meta.get("clip.vision.preproc_image_size", config.image_size)}}
    for key in ("image_mean", "image_std"):
        if "clip.vision." + key in meta:
            fields[key] = [float(x) for x in meta["clip.vision." + key]]
    return fields


def _hf_name(name: str, tower: str) -> str:
    """A llama.cpp mmproj tensor's Hugging Face name, its tower under `tower`; other names pass
    unchanged."""
    stem, _, kind = name.rpartition(".")
    if stem in _PROJECTOR_NAMES:
        return f"{_PROJECTOR_NAMES[stem]}.{kind}"
    if stem in _TOWER_NAMES:
        return f"{tower}{_TOWER_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in _LAYER_NAMES:
        return f"{tower}encoder.layers.{parts[2]}.{_LAYER_NAMES[parts[3]]}.{kind}"
    return name


def _float32(tensor: Any) -> torch.Tensor:
    """A tensor's values as float32, in the shape torch names them (GGUF lists dims in reverse)."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type in _FLOAT_TYPES:
        values = np.asarray(tensor.data)
        if tensor.tensor_type == GGMLQuantizationType.BF16:
            values = dequantize(values, tensor.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape))
