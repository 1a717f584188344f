"""A vision-language checkpoint's image side: its encoder's shape and its projector's.

Owns: `VisionConfig`, read from a Hugging Face config.json's `vision_config` and the fields
around it, and `VISION_FAMILIES`, the model types whose image side nanoserve runs (the text
side is an ordinary `ModelConfig`, read from `text_config`). Refuses: a vision family or an
encoder activation it does not implement, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.errors import UnsupportedModelError

# model_type of the checkpoint -> the encoder + projector that runs it (model/vision.py).
VISION_FAMILIES = ("idefics3",)
ENCODER_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True, slots=True)
class VisionConfig:
    family: str  # one of VISION_FAMILIES
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # the side of the square the position embeddings were trained on
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    text_hidden_size: int  # the width of the rows the projector writes (the text model's)
    image_token_id: int  # the placeholder token each image row replaces in the prompt
    scale_factor: int = 1  # Idefics3's pixel shuffle: scale_factor**2 patches become one row

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def rows_per_tile(self) -> int:
        """Embedding rows one image-size tile becomes: its patches, merged by the projector."""
        return self.patches_per_side ** 2 // self.scale_factor ** 2

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> VisionConfig | None:
        """The image side of config.json, or None for a text-only checkpoint."""
        if raw.get("vision_config") is None:
            return None
        family = raw.get("model_type")
        if family not in VISION_FAMILIES:
            raise UnsupportedModelError(f"config.json: model_type {family!r} has a vision tower nanoserve "
                                        "does not run; it runs the vision-language families "
                                        f"{', '.join(VISION_FAMILIES)}")
        vision, text = raw["vision_config"], raw["text_config"]
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ENCODER_ACTIVATIONS:
            raise UnsupportedModelError(f"config.json field 'vision_config.hidden_act' = {act!r}: "
                                        f"nanoserve's encoder runs {', '.join(ENCODER_ACTIVATIONS)}")
        config = cls(family=family, hidden_size=vision["hidden_size"],
                     intermediate_size=vision["intermediate_size"], num_layers=vision["num_hidden_layers"],
                     num_heads=vision["num_attention_heads"], num_channels=vision.get("num_channels", 3),
                     image_size=vision["image_size"], patch_size=vision["patch_size"],
                     layer_norm_eps=vision.get("layer_norm_eps", 1e-6), hidden_act=act,
                     text_hidden_size=text["hidden_size"], image_token_id=raw["image_token_id"],
                     scale_factor=raw.get("scale_factor", 1))
        if config.hidden_size % config.num_heads or config.patches_per_side % config.scale_factor:
            raise UnsupportedModelError("config.json: vision_config.hidden_size must divide by "
                                        "num_attention_heads and the patches per side by scale_factor")
        return config


def text_config_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config.json fields: a vision-language checkpoint's `text_config` (with
    the head tying the whole checkpoint declares), any other checkpoint's own fields."""
    if raw.get("vision_config") is None or raw.get("model_type") not in VISION_FAMILIES:
        return raw
    text = dict(raw["text_config"])
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text
