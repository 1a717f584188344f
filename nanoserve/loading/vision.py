"""A vision-language checkpoint folder's image side: its vision config and encoder weights.
The text model is read by `loading.weights` like any causal LM's (`text_tensors`).

Owns: the Hugging Face tensor names of each vision family's tower and projector (with their
shapes, checked before anything is built; LLaVA's and Gemma 3's under both the names transformers
5 saves and the older `model.vision_tower.vision_model.` ones; Qwen2-VL's and Qwen2.5-VL's under
`model.visual.` or the older `visual.`) and `load_image_encoder`.
Refuses: checkpoints whose vision tensors are missing or misshapen, naming the tensor (an
`mmproj` GGUF's tensors are renamed to these by `loading.mmproj`, then checked here too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from nanoserve.errors import UnsupportedModelError
from nanoserve.loading.weights import weight_files
from nanoserve.model.linear import LinearKernel
from nanoserve.model.qwen_vision import QwenVisionEncoder, QwenVisionLayer, QwenVisionWeights
from nanoserve.model.vision import EncoderLayerWeights, ImageEncoder, VisionWeights, build_encoder
from nanoserve.model.vision_config import QWEN_FAMILIES, VisionConfig


@dataclass(frozen=True, slots=True)
class TowerNames:
    tower: str  # the prefix of the ViT's tensors
    projector: tuple[str, ...]  # the projector's linears, in order (each `.weight`, maybe `.bias`)
    clip: bool  # CLIP's class token and pre-layernorm
    # Gemma 3: its soft-token RMSNorm (`.weight`), and its one matrix saved as x @ W's W
    # [vision hidden, text hidden], the transpose of a linear's weight.
    projector_norm: str | None = None
    projector_transposed: bool = False


NAMES = {"idefics3": TowerNames("model.vision_model.", ("model.connector.modality_projection.proj",),
                                clip=False),
         "llava": TowerNames("vision_tower.", ("multi_modal_projector.linear_1",
                                               "multi_modal_projector.linear_2"), clip=True),
         "gemma3": TowerNames("vision_tower.", ("multi_modal_projector.mm_input_projection",), clip=False,
                              projector_norm="multi_modal_projector.mm_soft_emb_norm",
                              projector_transposed=True)}
# Older and newer spellings of the same LLaVA and Gemma 3 tensors, to the one the map above uses.
_RENAMED = (("model.vision_tower.vision_model.", "vision_tower."),
            ("vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."))
# Gemma 3's projection matrix is a bare parameter: named here like a linear's weight.
_GEMMA3_PROJECTION = ("multi_modal_projector.mm_input_projection_weight",
                      "multi_modal_projector.mm_input_projection.weight")


def read_vision_config(model_dir: Path) -> VisionConfig | None:
    """The image side of `model_dir`'s config.json; None for a text-only model."""
    return VisionConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))


# Qwen2-VL / Qwen2.5-VL: the tower and merger under `model.visual.` (transformers 5) or `visual.`.
QWEN_TOWER = "visual."


def canonical_name(name: str) -> str:
    if name.startswith("model.visual."):
        return name[len("model."):]
    for old, new in _RENAMED:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return _GEMMA3_PROJECTION[1] if name == _GEMMA3_PROJECTION[0] else name


def vision_tensor_shapes(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision tensor a checkpoint of `config` must hold, with its shape (projector biases,
    optional, are checked where present)."""
    names = NAMES[config.family]
    hidden, ffn, p, v = config.hidden_size, config.intermediate_size, config.patch_size, names.tower
    positions = config.patches_per_side ** 2 + names.clip
    shapes = {v + "embeddings.patch_embedding.weight": (hidden, config.num_channels, p, p),
              v + "embeddings.position_embedding.weight": (positions, hidden)}
    if names.clip:
        shapes |= {v + "embeddings.class_embedding": (hidden,), v + "pre_layrnorm.weight": (hidden,),
                   v + "pre_layrnorm.bias": (hidden,)}
    else:
        shapes |= {v + "embeddings.patch_embedding.bias": (hidden,), v + "post_layernorm.weight": (hidden,),
                   v + "post_layernorm.bias": (hidden,)}
    for i in range(config.num_layers):
        layer = f"{v}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{layer}self_attn.{proj}.weight": (hidden, hidden),
                       f"{layer}self_attn.{proj}.bias": (hidden,)}
        for norm in ("layer_norm1", "layer_norm2"):
            shapes |= {f"{layer}{norm}.weight": (hidden,), f"{layer}{norm}.bias": (hidden,)}
        shapes |= {f"{layer}mlp.fc1.weight": (ffn, hidden), f"{layer}mlp.fc1.bias": (ffn,),
                   f"{layer}mlp.fc2.weight": (hidden, ffn), f"{layer}mlp.fc2.bias": (hidden,)}
    width = hidden * config.scale_factor ** 2
    for index, linear in enumerate(names.projector):
        inputs = width if index == 0 else config.text_hidden_size
        shape = (config.text_hidden_size, inputs)
        shapes[linear + ".weight"] = shape[::-1] if names.projector_transposed else shape
    if names.projector_norm is not None:
        shapes[names.projector_norm + ".weight"] = (width,)
    return shapes


def vision_weights(config: VisionConfig, tensors: dict[str, torch.Tensor]) -> VisionWeights:
    """The encoder's weights from checked Hugging Face tensors (canonical names)."""
    names = NAMES[config.family]
    v = names.tower

    def layer(i: int) -> EncoderLayerWeights:
        prefix = f"{v}encoder.layers.{i}."
        t = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
        attn = [t[f"self_attn.{proj}.weight"] for proj in ("q_proj", "k_proj", "v_proj")]
        attn_bias = [t[f"self_attn.{proj}.bias"] for proj in ("q_proj", "k_proj", "v_proj")]
        return EncoderLayerWeights(
            norm1=(t["layer_norm1.weight"], t["layer_norm1.bias"]), qkv=torch.cat(attn),
            qkv_bias=torch.cat(attn_bias), out=t["self_attn.out_proj.weight"],
            out_bias=t["self_attn.out_proj.bias"],
            norm2=(t["layer_norm2.weight"], t["layer_norm2.bias"]), fc1=t["mlp.fc1.weight"],
            fc1_bias=t["mlp.fc1.bias"], fc2=t["mlp.fc2.weight"], fc2_bias=t["mlp.fc2.bias"])

    def norm(name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (tensors[name + ".weight"], tensors[name + ".bias"]) if name + ".weight" in tensors else None

    patch = tensors[v + "embeddings.patch_embedding.weight"]
    return VisionWeights(
        patch=patch.reshape(patch.shape[0], -1),
        patch_bias=tensors.get(v + "embeddings.patch_embedding.bias"),
        positions=tensors[v + "embeddings.position_embedding.weight"],
        layers=[layer(i) for i in range(config.num_layers)],
        projector=[(tensors[linear + ".weight"].T.contiguous() if names.projector_transposed
                    else tensors[linear + ".weight"], tensors.get(linear + ".bias"))
                   for linear in names.projector],
        class_embedding=tensors.get(v + "embeddings.class_embedding"), pre_norm=norm(v + "pre_layrnorm"),
        post_norm=norm(v + "post_layernorm"),
        projector_norm=tensors[names.projector_norm + ".weight"] if names.projector_norm else None)


def qwen_tensor_shapes(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen2-VL / Qwen2.5-VL tower and merger, with its shape."""
    hidden, ffn, v = config.hidden_size, config.intermediate_size, QWEN_TOWER
    p, merged = config.patch_size, config.hidden_size * config.merge_size ** 2
    gated = config.family == "qwen2_5_vl"
    shapes = {v + "patch_embed.proj.weight": (hidden, config.num_channels, config.temporal_patch_size, p, p),
              v + "merger.ln_q.weight": (hidden,), v + "merger.mlp.0.weight": (merged, merged),
              v + "merger.mlp.0.bias": (merged,),
              v + "merger.mlp.2.weight": (config.text_hidden_size, merged),
              v + "merger.mlp.2.bias": (config.text_hidden_size,)}
    if not gated:
        shapes[v + "merger.ln_q.bias"] = (hidden,)
    mlp = (("gate_proj", "up_proj", "down_proj") if gated else ("fc1", "fc2"))
    for i in range(config.num_layers):
        block = f"{v}blocks.{i}."
        shapes |= {block + "attn.qkv.weight": (3 * hidden, hidden), block + "attn.qkv.bias": (3 * hidden,),
                   block + "attn.proj.weight": (hidden, hidden), block + "attn.proj.bias": (hidden,)}
        for norm in ("norm1", "norm2"):
            shapes[f"{block}{norm}.weight"] = (hidden,)
            if not gated:
                shapes[f"{block}{norm}.bias"] = (hidden,)
        for name in mlp[:-1]:
            shapes |= {f"{block}mlp.{name}.weight": (ffn, hidden), f"{block}mlp.{name}.bias": (ffn,)}
        shapes |= {f"{block}mlp.{mlp[-1]}.weight": (hidden, ffn), f"{block}mlp.{mlp[-1]}.bias": (hidden,)}
    return shapes


def qwen_vision_weights(config: VisionConfig, tensors: dict[str, torch.Tensor]) -> QwenVisionWeights:
    """The Qwen tower's weights from checked tensors (canonical names)."""
    v, gated = QWEN_TOWER, config.family == "qwen2_5_vl"

    def norm(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return tensors[name + ".weight"], tensors.get(name + ".bias")

    def layer(i: int) -> QwenVisionLayer:
        t = {name[len(f"{v}blocks.{i}."):]: tensor for name, tensor in tensors.items()
             if name.startswith(f"{v}blocks.{i}.")}
        ups = ("gate_proj", "up_proj") if gated else ("fc1",)
        return QwenVisionLayer(norm(f"{v}blocks.{i}.norm1"), t["attn.qkv.weight"], t["attn.qkv.bias"],
                               t["attn.proj.weight"], t["attn.proj.bias"], norm(f"{v}blocks.{i}.norm2"),
                               torch.cat([t[f"mlp.{u}.weight"] for u in ups]),
                               torch.cat([t[f"mlp.{u}.bias"] for u in ups]),
                               t[f"mlp.{'down_proj' if gated else 'fc2'}.weight"],
                               t[f"mlp.{'down_proj' if gated else 'fc2'}.bias"])

    patch = tensors[v + "patch_embed.proj.weight"]
    return QwenVisionWeights(patch.reshape(patch.shape[0], -1), [layer(i) for i in range(config.num_layers)],
                             norm(v + "merger.ln_q"),
                             [(tensors[f"{v}merger.mlp.{i}.weight"], tensors[f"{v}merger.mlp.{i}.bias"])
                              for i in (0, 2)])


def check_vision_tensors(model_dir: Path, config: VisionConfig, tensors: dict[str, torch.Tensor]) -> None:
    if config.family in QWEN_FAMILIES:
        _check_shapes(model_dir, qwen_tensor_shapes(config), tensors)
        return
    expected = vision_tensor_shapes(config)
    names = NAMES[config.family]
    for linear in names.projector:  # an optional bias, where there is one
        if linear + ".bias" in tensors:
            expected[linear + ".bias"] = (config.text_hidden_size,)
    _check_shapes(model_dir, expected, tensors)


def _check_shapes(model_dir: Path, expected: dict[str, tuple[int, ...]],
                  tensors: dict[str, torch.Tensor]) -> None:
    for name, shape in expected.items():
        if name not in tensors:
            raise UnsupportedModelError(f"{model_dir}: the checkpoint lacks the vision tensor {name} {shape}")
        if tuple(tensors[name].shape) != shape:
            raise UnsupportedModelError(f"{model_dir}: vision tensor {name} has shape "
                                        f"{tuple(tensors[name].shape)}; config.json implies {shape}")


def load_image_encoder(model_dir: Path, config: VisionConfig, *, dtype: torch.dtype, device: torch.device,
                       linear_kernel: LinearKernel | None = None, threads: int | None = None) -> ImageEncoder:
    """The family's encoder with `model_dir`'s weights (the vision tensors alone are read)."""
    qwen = config.family in QWEN_FAMILIES
    if qwen:
        wanted: tuple[str, ...] = (QWEN_TOWER,)
    else:
        names = NAMES[config.family]
        wanted = (names.tower, *names.projector, *filter(None, [names.projector_norm]))
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as file:
            for name in file.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                canonical = canonical_name(name)
                if canonical.startswith(wanted):
                    tensors[canonical] = file.get_tensor(name)
    check_vision_tensors(model_dir, config, tensors)
    weights = qwen_vision_weights(config, tensors) if qwen else vision_weights(config, tensors)
    return image_encoder(config, weights.to(dtype, device), linear_kernel, threads)


def image_encoder(config: VisionConfig, weights: VisionWeights | QwenVisionWeights,
                  linear_kernel: LinearKernel | None = None, threads: int | None = None) -> ImageEncoder:
    """The family's encoder over its built weights (a folder's or an mmproj file's): Qwen's own
    tower and merger, or `build_encoder`'s."""
    if config.family in QWEN_FAMILIES:
        return QwenVisionEncoder(config, weights, linear_kernel, threads)
    return build_encoder(config, weights, linear_kernel, threads)
