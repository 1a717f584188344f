"""llama.cpp's `mmproj` GGUF files: a vision tower and projector beside a text GGUF (`--mmproj`).

Owns: reading an mmproj file's `clip.*` metadata into a `VisionConfig` and the processor fields
the family's processor reads (tile size, the longest edge images are first resized to, mean and
std), and its `v.*` / `mm.*` tensors, under llama.cpp's names (gguf-py's tensor map), into the
Hugging Face names `loading.vision` builds the encoder from, so one builder serves both paths;
and each family's image token in the text model's vocabulary (`IMAGE_TOKENS`; LLaVA's images
take an id outside a vocabulary that lacks it, `PLACEHOLDER_OUTSIDE_VOCAB`). Gemma 3's
pooling is its `projector.scale_factor` (llama.cpp's default 4 where the file leaves it out),
and its soft-token norm is stored as 1 + w (its converter adds the one).
LLaVA-1.5 (`mlp`, as llama.cpp's convert_image_encoder_to_gguf.py writes it; the 2023 files say
only `clip.has_llava_projector`): CLIP's class token and pre-layernorm, `mm.0` / `mm.2` the
projector's linears with transformers' exact GELU between (ggml's is the tanh approximation),
the text width the projector's output (`projection_dim` is CLIP's own there). The converter keeps
the layers the projector reads: `clip.vision.feature_layer` names its layer (an index into
transformers' hidden_states), else it reads the last one kept (the converter dropped the tower's
last for LLaVA's -2; llama.cpp's graph drops one more, ggml-org/llama.cpp#25817). Its images are
padded to a square of the mean colour and resized to the tower's, as llama.cpp prepares them.
A block whose `ffn_down` reads the tower's width holds the up projection (the legacy converter
swapped the names): the two trade places, as clip.cpp tells them apart.
Qwen2-VL / Qwen2.5-VL (`qwen2vl_merger`, `qwen2.5vl_merger`, as convert_hf_to_gguf.py writes
them): q, k, v stacked back into qkv and the Conv3d's two frames (`v.patch_embd.weight`, `.weight.1`)
back into one kernel, under `loading.vision`'s Qwen names, so `qwen_vision_weights` builds both paths;
the MLP width read from its matrix (the converter writes Qwen2-VL's merger width as
feed_forward_length); Qwen2.5-VL's full-attention blocks from `n_wa_pattern`; what clip.cpp keeps
in code (merge 2, windows of 112 pixels) and the pixel bounds Qwen publishes (`QWEN_*_DEFAULT`)
where the file states none.
Refuses: a projector type other than those listed in `PROJECTORS`, a file without a vision
encoder, a LLaVA file with several feature layers (Granite's stack), LLaVA-NeXT's tiles
(`image_grid_pinpoints`) or a SiLU tower, a Qwen file lacking a key or tensor it needs or with
windows that split a merged patch, naming the file and the field; a vocabulary without the
family's image token (but LLaVA's), naming the token.
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
from nanoserve.loading.gguf import f32_to_float
from nanoserve.loading.vision import (
    QWEN_TOWER,
    check_vision_tensors,
    qwen_tensor_shapes,
    qwen_vision_weights,
    vision_weights,
)
from nanoserve.model.qwen_vision import QwenVisionWeights
from nanoserve.model.vision import VisionWeights
from nanoserve.model.vision_config import QWEN_FAMILIES, VisionConfig

# llama.cpp's projector type -> the vision family that runs it
PROJECTORS = {"idefics3": "idefics3", "gemma3": "gemma3", "mlp": "llava", "qwen2vl_merger": "qwen2_vl",
              "qwen2.5vl_merger": "qwen2_5_vl"}
# The token each family's image rows replace, as the text model's vocabulary spells it.
IMAGE_TOKENS = {"idefics3": "<image>", "gemma3": "<image_soft_token>", "llava": "<image>",
                "qwen2_vl": "<|image_pad|>", "qwen2_5_vl": "<|image_pad|>"}
# The families whose image rows take an id outside the vocabulary where it lacks their token:
# LLaVA-1.5's text GGUFs keep Llama's 32,000 tokens (llama.cpp's llava surgery adds none), and
# llama.cpp's mtmd splits the prompt at the marker's text instead of looking a token up. An image
# of the others expands to text around its rows whose tokens the vocabulary must hold.
PLACEHOLDER_OUTSIDE_VOCAB = frozenset({"llava"})
# Each family's Hugging Face tower prefix and projector names (loading.vision's NAMES).
_TOWERS = {"idefics3": "model.vision_model.", "gemma3": "vision_tower.", "llava": "vision_tower."}
_PROJECTOR_NAMES = {
    "idefics3": {"mm.model.fc": "model.connector.modality_projection.proj"},
    "gemma3": {"mm.input_projection": "multi_modal_projector.mm_input_projection",
               "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm"},
    # LLaVA's projector was an nn.Sequential(Linear, GELU, Linear): its linears are modules 0 and 2.
    "llava": {"mm.0": "multi_modal_projector.linear_1", "mm.2": "multi_modal_projector.linear_2"}}
GEMMA3_SCALE_FACTOR_DEFAULT = 4  # clip.cpp's pooling kernel for gemma3 when the file names none
LLAVA_LAYER_NORM_EPS_DEFAULT = 1e-5  # CLIPVisionConfig's
# Per-layer names: llama.cpp's (v.blk.N.<name>) -> Hugging Face's (encoder.layers.N.<name>)
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_TOWER_NAMES = {"v.patch_embd": "embeddings.patch_embedding",
                "v.position_embd": "embeddings.position_embedding", "v.post_ln": "post_layernorm",
                "v.pre_ln": "pre_layrnorm"}
_CLASS_EMBEDDING = "v.class_embd"  # CLIP's class token: a bare vector, no `.weight`
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def read_mmproj(path: Path, token_id: Callable[[str], int | None], id_outside_vocab: int | None = None
                ) -> tuple[VisionConfig, VisionWeights | QwenVisionWeights, dict[str, Any]]:
    """The tower's config (`token_id`: the text model's vocabulary, where its family's image
    token is looked up; a family of `PLACEHOLDER_OUTSIDE_VOCAB` takes `id_outside_vocab` where the
    vocabulary lacks it), its float32 weights, and the processor fields its metadata gives
    (preprocessor_config.json's names)."""
    reader = GGUFReader(str(path))
    meta = {field.name: field.contents() for field in reader.fields.values()}
    family = _family(path, meta)
    image_token_id = token_id(IMAGE_TOKENS[family])
    if image_token_id is None and family in PLACEHOLDER_OUTSIDE_VOCAB:
        image_token_id = id_outside_vocab
    if image_token_id is None:
        raise UnsupportedModelError(f"the text model's vocabulary has no {IMAGE_TOKENS[family]} token for "
                                    f"{path.name}'s images")
    if family in QWEN_FAMILIES:
        return _read_qwen(path, meta, {tensor.name: tensor for tensor in reader.tensors}, family,
                                image_token_id)
    tensors = {_hf_name(tensor.name, family): _float32(tensor) for tensor in reader.tensors}
    config = _config(path, meta, family, image_token_id, tensors)
    _unswap_ffn(tensors, config)
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    if norm in tensors:  # llama.cpp's converter stores Gemma's (1 + w): back to transformers' w
        tensors[norm] = tensors[norm] - 1.0
    check_vision_tensors(path, config, tensors)
    return config, vision_weights(config, tensors), _processor_fields(meta, config)


def _family(path: Path, meta: dict[str, Any]) -> str:
    projector = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if projector is None and meta.get("clip.has_llava_projector"):
        projector = "mlp"  # the 2023 converter named no projector type: LLaVA's was the only one
    if not meta.get("clip.has_vision_encoder", projector is not None):
        raise UnsupportedModelError(f"{path}: the mmproj file has no vision encoder "
                                    "(clip.has_vision_encoder)")
    if projector not in PROJECTORS:
        raise UnsupportedModelError(f"{path}: clip.projector_type {projector!r} is not supported; nanoserve "
                                    f"runs {', '.join(PROJECTORS)}")
    return PROJECTORS[projector]


def _need(path: Path, meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedModelError(f"{path}: the mmproj file lacks the metadata {key}")
    return meta[key]


def _config(path: Path, meta: dict[str, Any], family: str, image_token_id: int,
            tensors: dict[str, torch.Tensor]) -> VisionConfig:
    v = "clip.vision."
    shape = dict(family=family, hidden_size=_need(path, meta, v + "embedding_length"),
                 intermediate_size=_need(path, meta, v + "feed_forward_length"),
                 num_layers=_need(path, meta, v + "block_count"),
                 num_heads=_need(path, meta, v + "attention.head_count"), num_channels=3,
                 image_size=_need(path, meta, v + "image_size"),
                 patch_size=_need(path, meta, v + "patch_size"),
                 layer_norm_eps=meta.get(v + "attention.layer_norm_epsilon", 1e-6),
                 hidden_act="gelu_pytorch_tanh", image_token_id=image_token_id)
    if family == "llava":
        return VisionConfig(**shape | _llava_fields(path, meta, shape["num_layers"], tensors))
    shape["text_hidden_size"] = _need(path, meta, v + "projection_dim")
    if family == "idefics3":
        return VisionConfig(**shape, scale_factor=meta.get(v + "projector.scale_factor", 1))
    kernel = meta.get(v + "projector.scale_factor", GEMMA3_SCALE_FACTOR_DEFAULT)
    grid = shape["image_size"] // shape["patch_size"]
    if kernel < 1 or grid % kernel:
        raise UnsupportedModelError(f"{path}: clip.vision.projector.scale_factor {kernel} does not divide "
                                    f"the {grid} x {grid} patch grid")
    return VisionConfig(**shape, tokens_per_image=(grid // kernel) ** 2, bidirectional=True)


def _llava_fields(path: Path, meta: dict[str, Any], num_layers: int,
                  tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """LLaVA-1.5's choices as llama.cpp's file states them: the layer read (the last kept where the
    file names none), the class token's row dropped, the tower's activation, the projector's
    output width as the text width."""
    if "clip.vision.image_grid_pinpoints" in meta:
        raise UnsupportedModelError(f"{path}: clip.vision.image_grid_pinpoints: LLaVA-NeXT's image tiles are "
                                    "not supported; nanoserve runs LLaVA-1.5's one image")
    if meta.get("clip.use_silu"):
        raise UnsupportedModelError(f"{path}: clip.use_silu: a LLaVA tower runs GELU (clip.use_gelu) or "
                                    "CLIP's quick GELU")
    layers = meta.get("clip.vision.feature_layer")
    layers = [-1] if layers is None else list(layers) if isinstance(layers, list) else [layers]
    if len(layers) != 1 or not -1 <= layers[0] <= num_layers:
        raise UnsupportedModelError(f"{path}: clip.vision.feature_layer {layers}: nanoserve reads one layer "
                                    f"of the {num_layers} kept")
    last = tensors.get("multi_modal_projector.linear_2.weight")
    if last is None or last.dim() != 2:
        raise UnsupportedModelError(f"{path}: the mmproj file lacks the projector matrix mm.2.weight")
    eps = meta.get("clip.vision.attention.layer_norm_epsilon", LLAVA_LAYER_NORM_EPS_DEFAULT)
    return dict(hidden_act="gelu" if meta.get("clip.use_gelu") else "quick_gelu", layer_norm_eps=eps,
                text_hidden_size=last.shape[0], feature_layer=int(layers[0]), class_token=True,
                drop_class_token=True, projector_act="gelu")


def _unswap_ffn(tensors: dict[str, torch.Tensor], config: VisionConfig) -> None:
    """clip.cpp's rule: a block whose `ffn_down` matrix reads the tower's width holds fc1 under that
    name (the legacy converter named fc1 `ffn_down` and fc2 `ffn_up`): the two trade places."""
    for i in range(config.num_layers):
        up, down = (f"{_TOWERS[config.family]}encoder.layers.{i}.mlp.{fc}" for fc in ("fc1", "fc2"))
        matrix = tensors.get(down + ".weight")
        if matrix is None or up + ".weight" not in tensors or matrix.shape[-1] != config.hidden_size:
            continue
        for kind in (".weight", ".bias"):
            held = {name: tensors.pop(name + kind) for name in (up, down) if name + kind in tensors}
            tensors |= {(down if name == up else up) + kind: value for name, value in held.items()}


def _processor_fields(meta: dict[str, Any], config: VisionConfig) -> dict[str, Any]:
    square = {"height": config.image_size, "width": config.image_size}
    if config.family == "gemma3":
        fields: dict[str, Any] = {"size": square}
    elif config.family == "llava":
        fields = {"size": {"shortest_edge": config.image_size}, "crop_size": square, "do_pad": True}
    else:
        fields = {"max_image_size": {"longest_edge": config.image_size},
                  "size": {"longest_edge": meta.get("clip.vision.preproc_image_size", config.image_size)}}
    for key in ("image_mean", "image_std"):
        if "clip.vision." + key in meta:
            fields[key] = [float(x) for x in meta["clip.vision." + key]]
    return fields


def _hf_name(name: str, family: str) -> str:
    """A llama.cpp mmproj tensor's Hugging Face name under `family`'s tower and projector; other
    names pass unchanged."""
    tower, projector = _TOWERS[family], _PROJECTOR_NAMES[family]
    if name == _CLASS_EMBEDDING:
        return f"{tower}embeddings.class_embedding"
    stem, _, kind = name.rpartition(".")
    if stem in projector:
        return f"{projector[stem]}.{kind}"
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


# ---- Qwen2-VL / Qwen2.5-VL ----------------------------------------------------------------
# What clip.cpp keeps in code for `qwen2vl_merger` / `qwen2.5vl_merger` files, which
# convert_hf_to_gguf.py's Qwen2VLVisionModel does not write (read where a file states them):
QWEN_MERGE_SIZE_DEFAULT = 2  # `spatial_merge_size`: clip.cpp's n_merge for Qwen 2 and 2.5
# `window_size`: clip.cpp's attn_window_size is 112 pixels for every qwen2.5vl file (every Qwen2.5-VL
# checkpoint's, and Qwen2_5_VLVisionConfig's default).
QWEN_WINDOW_SIZE_DEFAULT = 112
# `image_min_pixels` / `image_max_pixels`: the bounds of smart_resize, in merged rows. An mmproj
# carries no preprocessor_config.json; these are the bounds Qwen's own checkpoints publish there
# (min_pixels 3136 = 4 rows and max_pixels 12845056 = 16384 rows of 28 x 28 pixels), so a pair
# reads an image into the same rows as the Hugging Face folder it came from. clip.cpp chooses
# 8 to 4096 rows instead (a memory limit of its own: a large image gets fewer rows there).
QWEN_MIN_ROWS_DEFAULT, QWEN_MAX_ROWS_DEFAULT = 4, 16384
# Hugging Face's tower names (loading.vision's, under QWEN_TOWER) -> llama.cpp's (gguf-py's tensor map)
_QWEN_LAYER_NAMES = {"attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2", "mlp.fc1": "ffn_up",
                     "mlp.fc2": "ffn_down", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down"}
# The converter split the Conv3d over a still image's two frames into one matrix per frame.
_QWEN_PATCH_FRAMES = ("v.patch_embd.weight", "v.patch_embd.weight.1")


def _read_qwen(path: Path, meta: dict[str, Any], stored: dict[str, Any], family: str,
               image_token_id: int) -> tuple[VisionConfig, QwenVisionWeights, dict[str, Any]]:
    """A Qwen2-VL / Qwen2.5-VL tower and merger as convert_hf_to_gguf.py writes them: q, k and v
    apart (stacked back into qkv), the patch convolution as two frames (stacked back into the
    Conv3d), the merger's norm `v.post_ln` and linears `mm.0` / `mm.2`."""
    config = _qwen_config(path, meta, stored, family, image_token_id)
    tensors = {}
    for name, shape in qwen_tensor_shapes(config).items():
        sources, axis = _qwen_sources(name)
        # each source's shape: the tensor's, less the frame axis, or a third of qkv's rows
        part_shape = (shape if axis is None else shape[:2] + shape[3:] if axis == 2
                      else (shape[0] // 3, *shape[1:]))
        parts = []
        for source in sources:
            if source not in stored:
                raise UnsupportedModelError(f"{path}: the mmproj file lacks the tensor {source} {part_shape}")
            parts.append(_float32(stored[source]))
            if tuple(parts[-1].shape) != part_shape:
                raise UnsupportedModelError(f"{path}: mmproj tensor {source} has shape "
                                            f"{tuple(parts[-1].shape)}; the metadata implies {part_shape}")
        tensors[name] = (parts[0] if axis is None else torch.stack(parts, dim=2) if axis == 2
                         else torch.cat(parts))
    return config, qwen_vision_weights(config, tensors), _qwen_processor_fields(meta, config)


def _qwen_sources(name: str) -> tuple[tuple[str, ...], int | None]:
    """The mmproj tensors a Qwen tower tensor (loading.vision's name) is made of, and the axis they
    are stacked on (None: one tensor as it is)."""
    stem, kind = name.removeprefix(QWEN_TOWER).rsplit(".", 1)
    if stem == "patch_embed.proj":
        return _QWEN_PATCH_FRAMES, 2
    if stem == "merger.ln_q":
        return (f"v.post_ln.{kind}",), None
    if stem.startswith("merger.mlp."):  # the merger's nn.Sequential(Linear, GELU, Linear): 0 and 2
        return (f"mm.{stem.rsplit('.', 1)[1]}.{kind}",), None
    _, layer, part = stem.split(".", 2)
    if part == "attn.qkv":
        return tuple(f"v.blk.{layer}.attn_{x}.{kind}" for x in "qkv"), 0
    return (f"v.blk.{layer}.{_QWEN_LAYER_NAMES[part]}.{kind}",), None


def _qwen_config(path: Path, meta: dict[str, Any], stored: dict[str, Any], family: str,
                 image_token_id: int) -> VisionConfig:
    v = "clip.vision."
    hidden, heads = _need(path, meta, v + "embedding_length"), _need(path, meta, v + "attention.head_count")
    if hidden % heads or (hidden // heads) % 4:
        raise UnsupportedModelError(f"{path}: {v}attention.head_count {heads}: the head width "
                                    f"({hidden} / heads) must divide by 4 (the 2D rotary embedding)")
    # The MLP's width from its matrix (GGUF lists its rows last), as clip.cpp reads it: for Qwen2-VL
    # the converter writes vision_config.hidden_size (the merger's output width) as feed_forward_length.
    up = stored.get("v.blk.0.ffn_up.weight")
    if up is None:
        raise UnsupportedModelError(f"{path}: the mmproj file lacks the tensor v.blk.0.ffn_up.weight")
    patch = _need(path, meta, v + "patch_size")
    merge = meta.get(v + "spatial_merge_size", QWEN_MERGE_SIZE_DEFAULT)
    layers = _need(path, meta, v + "block_count")
    window, full = 0, ()
    if family == "qwen2_5_vl":
        # clip.cpp's window pattern: every n-th block attends to the whole image (HF's
        # fullatt_block_indexes n-1, 2n-1, ...), the others within their windows.
        pattern = _need(path, meta, v + "n_wa_pattern")
        window = meta.get(v + "window_size", QWEN_WINDOW_SIZE_DEFAULT)
        if not isinstance(pattern, int) or pattern < 1:
            raise UnsupportedModelError(f"{path}: {v}n_wa_pattern = {pattern!r}: a block count of at least 1")
        if window % (patch * merge):
            raise UnsupportedModelError(f"{path}: {v}window_size {window}: a window is whole merged patches "
                                        f"({patch * merge} pixels)")
        full = tuple(i for i in range(layers) if (i + 1) % pattern == 0)
    # clip.cpp's activation rule: use_gelu, use_silu, else CLIP's quick GELU (Qwen2-VL's).
    act = "gelu" if meta.get("clip.use_gelu") else "silu" if meta.get("clip.use_silu") else "quick_gelu"
    return VisionConfig(family=family, hidden_size=hidden, intermediate_size=int(up.shape[-1]),
                        num_layers=layers, num_heads=heads, num_channels=3, image_size=patch * merge,
                        patch_size=patch,
                        layer_norm_eps=f32_to_float(meta.get(v + "attention.layer_norm_epsilon", 1e-6)),
                        hidden_act=act, text_hidden_size=_need(path, meta, v + "projection_dim"),
                        image_token_id=image_token_id, merge_size=merge,
                        temporal_patch_size=len(_QWEN_PATCH_FRAMES), window_size=window,
                        full_attention_layers=full)


def _qwen_processor_fields(meta: dict[str, Any], config: VisionConfig) -> dict[str, Any]:
    row_pixels = (config.patch_size * config.merge_size) ** 2
    fields: dict[str, Any] = {
        "min_pixels": meta.get("clip.vision.image_min_pixels", QWEN_MIN_ROWS_DEFAULT * row_pixels),
        "max_pixels": meta.get("clip.vision.image_max_pixels", QWEN_MAX_ROWS_DEFAULT * row_pixels)}
    for key in ("image_mean", "image_std"):
        if "clip.vision." + key in meta:
            fields[key] = [float(x) for x in meta["clip.vision." + key]]
    return fields
