"""A vision-language checkpoint folder's image side: its vision config and encoder weights.
The text model is read by `loading.weights` like any causal LM's (`text_tensors`).

Owns: the Hugging Face tensor names of each vision family's encoder and projector (with their
shapes, checked before anything is built) and `load_image_encoder`.
Refuses: GGUF `mmproj` files (not read yet) and checkpoints whose vision tensors are missing or
misshapen, naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from nanoserve.errors import UnsupportedModelError
from nanoserve.loading.weights import weight_files
from nanoserve.model.linear import LinearKernel
from nanoserve.model.vision import EncoderLayerWeights, ImageEncoder, VisionWeights, build_encoder
from nanoserve.model.vision_config import VisionConfig

# Idefics3ForConditionalGeneration's prefixes (SmolVLM's checkpoints use the same).
_VISION_PREFIX = "model.vision_model."
_PROJECTOR = "model.connector.modality_projection.proj.weight"


def read_vision_config(model_dir: Path) -> VisionConfig | None:
    """The image side of `model_dir`'s config.json; None for a text-only model."""
    return VisionConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))


def vision_tensor_shapes(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision tensor an Idefics3 checkpoint of `config` holds, with its shape."""
    hidden, ffn, p = config.hidden_size, config.intermediate_size, config.patch_size
    v = _VISION_PREFIX
    shapes = {v + "embeddings.patch_embedding.weight": (hidden, config.num_channels, p, p),
              v + "embeddings.patch_embedding.bias": (hidden,),
              v + "embeddings.position_embedding.weight": (config.patches_per_side ** 2, hidden),
              v + "post_layernorm.weight": (hidden,), v + "post_layernorm.bias": (hidden,),
              _PROJECTOR: (config.text_hidden_size, hidden * config.scale_factor ** 2)}
    for i in range(config.num_layers):
        layer = f"{v}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{layer}self_attn.{proj}.weight": (hidden, hidden),
                       f"{layer}self_attn.{proj}.bias": (hidden,)}
        for norm in ("layer_norm1", "layer_norm2"):
            shapes |= {f"{layer}{norm}.weight": (hidden,), f"{layer}{norm}.bias": (hidden,)}
        shapes |= {f"{layer}mlp.fc1.weight": (ffn, hidden), f"{layer}mlp.fc1.bias": (ffn,),
                   f"{layer}mlp.fc2.weight": (hidden, ffn), f"{layer}mlp.fc2.bias": (hidden,)}
    return shapes


def vision_weights(config: VisionConfig, tensors: dict[str, torch.Tensor]) -> VisionWeights:
    """The encoder's weights from checked Hugging Face tensors."""
    v = _VISION_PREFIX

    def layer(i: int) -> EncoderLayerWeights:
        t = {name[len(f"{v}encoder.layers.{i}."):]: tensor for name, tensor in tensors.items()
             if name.startswith(f"{v}encoder.layers.{i}.")}
        attn = [t[f"self_attn.{proj}.weight"] for proj in ("q_proj", "k_proj", "v_proj")]
        attn_bias = [t[f"self_attn.{proj}.bias"] for proj in ("q_proj", "k_proj", "v_proj")]
        return EncoderLayerWeights(
            norm1=(t["layer_norm1.weight"], t["layer_norm1.bias"]), qkv=torch.cat(attn),
            qkv_bias=torch.cat(attn_bias),
            out=t["self_attn.out_proj.weight"], out_bias=t["self_attn.out_proj.bias"],
            norm2=(t["layer_norm2.weight"], t["layer_norm2.bias"]), fc1=t["mlp.fc1.weight"],
            fc1_bias=t["mlp.fc1.bias"], fc2=t["mlp.fc2.weight"], fc2_bias=t["mlp.fc2.bias"])

    patch = tensors[v + "embeddings.patch_embedding.weight"]
    return VisionWeights(
        patch=patch.reshape(patch.shape[0], -1), patch_bias=tensors[v + "embeddings.patch_embedding.bias"],
        positions=tensors[v + "embeddings.position_embedding.weight"],
        layers=[layer(i) for i in range(config.num_layers)],
        post_norm=(tensors[v + "post_layernorm.weight"], tensors[v + "post_layernorm.bias"]),
        projector=tensors[_PROJECTOR])


def check_vision_tensors(model_dir: Path, config: VisionConfig, tensors: dict[str, torch.Tensor]) -> None:
    for name, shape in vision_tensor_shapes(config).items():
        if name not in tensors:
            raise UnsupportedModelError(f"{model_dir}: the checkpoint lacks the vision tensor {name} {shape}")
        if tuple(tensors[name].shape) != shape:
            raise UnsupportedModelError(f"{model_dir}: vision tensor {name} has shape "
                                        f"{tuple(tensors[name].shape)}; config.json implies {shape}")


def load_image_encoder(model_dir: Path, config: VisionConfig, *, dtype: torch.dtype, device: torch.device,
                       linear_kernel: LinearKernel | None = None) -> ImageEncoder:
    """The family's encoder with `model_dir`'s weights (the vision tensors alone are read)."""
    wanted = vision_tensor_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as file:
            for name in file.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                if name in wanted:
                    tensors[name] = file.get_tensor(name)
    check_vision_tensors(model_dir, config, tensors)
    weights = vision_weights(config, tensors).to(dtype, device)
    return build_encoder(config, weights, linear_kernel)
