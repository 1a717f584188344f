"""A vision-language checkpoint's image side: its encoder's shape and its projector's.

Owns: `VisionConfig`, read from a Hugging Face config.json's `vision_config` and the fields
around it, and `VISION_FAMILIES`, the model types whose image side nanoserve runs: Idefics3 /
SmolVLM, LLaVA-1.5, Gemma 3, Qwen2-VL, Qwen2.5-VL (the text side is an ordinary `ModelConfig`,
read from `text_config` over its text family's defaults; Qwen's as Qwen2 with its M-RoPE
section, from `text_config` or an older checkpoint's top-level fields). Refuses: a vision family or an
encoder activation it does not implement, naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nanoserve.errors import UnsupportedModelError

# model_type of the checkpoint -> the encoder + projector that runs it (model/vision.py).
# config.json's model_type -> the family that runs it (SmolVLM2 is Idefics3's architecture)
VISION_FAMILIES = {"idefics3": "idefics3", "smolvlm": "idefics3", "llava": "llava", "gemma3": "gemma3",
                   "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl"}
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl")  # their own tower and merger (model/qwen_vision.py)
ENCODER_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "quick_gelu", "silu")
# Each family's tower model_type (older transformers saved Idefics3's as "idefics3"), and the
# tower's activation when vision_config leaves it out (the transformers config class's default).
VISION_MODEL_TYPES = {"idefics3": ("idefics3_vision", "idefics3", "smolvlm_vision"),
                      "llava": ("clip_vision_model",), "gemma3": ("siglip_vision_model",),
                      "qwen2_vl": ("qwen2_vl", "qwen2_vl_vision"),
                      "qwen2_5_vl": ("qwen2_5_vl", "qwen2_5_vl_vision")}
DEFAULT_ACTIVATION = {"idefics3": "gelu_pytorch_tanh", "llava": "quick_gelu", "gemma3": "gelu_pytorch_tanh",
                      "qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu"}
LLAVA_IMAGE_TOKEN_DEFAULT = 32000  # LlavaConfig's image_token_index when config.json leaves it out
# Gemma3Config's defaults: its placeholder token and the rows one image is pooled to.
GEMMA3_IMAGE_TOKEN_DEFAULT = 262144
GEMMA3_TOKENS_PER_IMAGE_DEFAULT = 256
# LlamaConfig's defaults: a LLaVA checkpoint's text_config lists only the fields it changed.
LLAMA_DEFAULTS = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                  "rms_norm_eps": 1e-6, "hidden_act": "silu"}
# Gemma3TextConfig's defaults: google's Gemma 3 checkpoints list only the fields they changed.
GEMMA3_TEXT_DEFAULTS = {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2304,
                        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
                        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 4096,
                        "hidden_activation": "gelu_pytorch_tanh", "rope_local_base_freq": 10000.0}
GEMMA3_ROPE_THETA_DEFAULT = 1000000.0  # its full layers' base, when neither rope field states one
# Qwen2VLTextConfig's (and Qwen2.5-VL's) defaults, and the fields of an older checkpoint's top
# level (its text fields sit there, beside vision_config) that are not the text model's.
QWEN_VL_TEXT_DEFAULTS = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 8192,
                         "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
                         "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                         "hidden_act": "silu"}
QWEN_VL_ROPE_THETA_DEFAULT = 1000000.0  # when neither rope field states one
QWEN_VL_TOP_LEVEL_ONLY = ("architectures", "model_type", "vision_config", "text_config", "image_token_id",
                          "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id",
                          "transformers_version", "dtype", "torch_dtype")
QWEN_IMAGE_TOKEN_DEFAULT = 151655  # Qwen2VLConfig's image_token_id: <|image_pad|>
TEXT_DEFAULTS = {"idefics3": LLAMA_DEFAULTS, "llava": LLAMA_DEFAULTS, "gemma3": GEMMA3_TEXT_DEFAULTS,
                 "qwen2_vl": QWEN_VL_TEXT_DEFAULTS, "qwen2_5_vl": QWEN_VL_TEXT_DEFAULTS}


@dataclass(frozen=True, slots=True)
class VisionConfig:
    family: str  # one of VISION_FAMILIES' values
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
    # Which of transformers' hidden_states the projector reads (0: the embeddings, -1: the last
    # layer's output); None: the last layer through the post-layernorm (SigLIP in Idefics3).
    feature_layer: int | None = None
    class_token: bool = False  # CLIP: a class token leads each tile's tokens
    drop_class_token: bool = False  # LLaVA's "default" feature selection: the class token's row goes
    projector_act: str | None = None  # between the projector's linears (LLaVA's GELU); None: one linear
    # Gemma 3: the patch grid average-pooled to this many rows (a square), then its soft-token
    # RMSNorm before the one linear; 0: no pooling.
    tokens_per_image: int = 0
    # Gemma 3: an image's rows attend to each other both ways in the text model (the text stays
    # causal), so a prompt chunk never ends inside one.
    bidirectional: bool = False
    # Qwen2-VL / Qwen2.5-VL: merge_size x merge_size patches become one row, each patch of
    # temporal_patch_size frames (a still image repeated), its ViT's 2D RoPE base; Qwen2.5-VL's
    # window attention over window_size-pixel squares on every block but full_attention_layers.
    merge_size: int = 1
    temporal_patch_size: int = 1
    rope_theta: float = 10000.0
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def rows_per_tile(self) -> int:
        """Embedding rows one image-size tile becomes: its patches, merged by the projector (and
        CLIP's class token where the projector reads it)."""
        if self.tokens_per_image:
            return self.tokens_per_image
        kept_class = self.class_token and not self.drop_class_token
        return self.patches_per_side ** 2 // self.scale_factor ** 2 + kept_class

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> VisionConfig | None:
        """The image side of config.json, or None for a text-only checkpoint."""
        if raw.get("vision_config") is None:
            return None
        family = VISION_FAMILIES.get(raw.get("model_type"))
        if family is None:
            raise UnsupportedModelError(f"config.json: model_type {raw.get('model_type')!r} has a vision "
                                        "tower nanoserve does not run; it runs the vision-language families "
                                        f"{', '.join(VISION_FAMILIES)}")
        vision, text = raw["vision_config"], text_config_dict(raw)
        if family in QWEN_FAMILIES:
            return _qwen_config(raw, vision, text, family)
        if vision.get("model_type", VISION_MODEL_TYPES[family][0]) not in VISION_MODEL_TYPES[family]:
            raise UnsupportedModelError(f"config.json field 'vision_config.model_type' = "
                                        f"{vision['model_type']!r}: a {family} checkpoint's tower runs as "
                                        f"{VISION_MODEL_TYPES[family][0]}")
        act = vision.get("hidden_act", DEFAULT_ACTIVATION[family])
        if act not in ENCODER_ACTIVATIONS:
            raise UnsupportedModelError(f"config.json field 'vision_config.hidden_act' = {act!r}: "
                                        f"nanoserve's encoder runs {', '.join(ENCODER_ACTIVATIONS)}")
        shape = dict(family=family, hidden_size=vision["hidden_size"],
                     intermediate_size=vision["intermediate_size"], num_layers=vision["num_hidden_layers"],
                     num_heads=vision["num_attention_heads"], num_channels=vision.get("num_channels", 3),
                     image_size=vision["image_size"], patch_size=vision["patch_size"], hidden_act=act,
                     text_hidden_size=text["hidden_size"])
        if family == "idefics3":
            config = cls(**shape, layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
                         image_token_id=raw["image_token_id"], scale_factor=raw.get("scale_factor", 1))
        elif family == "gemma3":
            config = cls(**shape, **_gemma3_fields(raw, vision))
        else:
            config = cls(**shape, **_llava_fields(raw, vision))
        if config.hidden_size % config.num_heads or config.patches_per_side % config.scale_factor:
            raise UnsupportedModelError("config.json: vision_config.hidden_size must divide by "
                                        "num_attention_heads and the patches per side by scale_factor")
        return config


def _qwen_config(raw: dict[str, Any], vision: dict[str, Any], text: dict[str, Any],
                 family: str) -> VisionConfig:
    """Qwen2-VL's tower (embed_dim wide, mlp_ratio, LayerNorm) or Qwen2.5-VL's (hidden_size wide,
    intermediate_size, RMSNorm, windows), its merger writing the text model's width."""
    if vision.get("model_type", family) not in VISION_MODEL_TYPES[family]:
        raise UnsupportedModelError(f"config.json field 'vision_config.model_type' = "
                                    f"{vision['model_type']!r}: a {family} checkpoint's tower runs as "
                                    f"{VISION_MODEL_TYPES[family][-1]}")
    act = vision.get("hidden_act", DEFAULT_ACTIVATION[family])
    if act not in ENCODER_ACTIVATIONS:
        raise UnsupportedModelError(f"config.json field 'vision_config.hidden_act' = {act!r}: "
                                    f"nanoserve's encoder runs {', '.join(ENCODER_ACTIVATIONS)}")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise UnsupportedModelError(f"config.json field 'vision_config.rope_parameters' = {rope!r}: the "
                                    "tower's rotary embedding is axial")
    patch, merge = vision.get("patch_size", 14), vision.get("spatial_merge_size", 2)
    if family == "qwen2_vl":
        hidden = vision.get("embed_dim", 1280)
        shape = dict(hidden_size=hidden, intermediate_size=int(hidden * vision.get("mlp_ratio", 4)))
        window, full = 0, ()
    else:
        hidden = vision.get("hidden_size", 1280)
        shape = dict(hidden_size=hidden, intermediate_size=vision.get("intermediate_size", 3420))
        window = vision.get("window_size", 112)
        full = tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31)))
        if window % (patch * merge):
            raise UnsupportedModelError(f"config.json field 'vision_config.window_size' = {window!r}: a "
                                        f"window is whole merged patches ({patch * merge} pixels)")
    heads = vision.get("num_heads", 16)
    if hidden % heads or (hidden // heads) % 4:
        raise UnsupportedModelError("config.json: vision_config's head width (hidden / num_heads) must "
                                    "divide by 4 (its 2D rotary embedding rotates rows and columns)")
    return VisionConfig(family=family, **shape, num_layers=vision.get("depth", 32), num_heads=heads,
                        num_channels=vision.get("in_channels", vision.get("in_chans", 3)),
                        image_size=patch * merge, patch_size=patch,
                        layer_norm_eps=1e-6, hidden_act=act, text_hidden_size=text["hidden_size"],
                        image_token_id=raw.get("image_token_id", QWEN_IMAGE_TOKEN_DEFAULT), merge_size=merge,
                        temporal_patch_size=vision.get("temporal_patch_size", 2),
                        rope_theta=float(rope.get("rope_theta", 10000.0)), window_size=window,
                        full_attention_layers=full)


def _qwen_text(raw: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2-VL / Qwen2.5-VL text model as a Qwen2 config: its `text_config` (or an older
    checkpoint's top-level fields) over Qwen2VLTextConfig's defaults, M-RoPE's section moved
    out of its RoPE dict into `mrope_section` (an older `rope_scaling` type "mrope" is the
    default RoPE with it)."""
    stated = raw.get("text_config")
    if stated is None:
        stated = {k: v for k, v in raw.items() if k not in QWEN_VL_TOP_LEVEL_ONLY}
    text = QWEN_VL_TEXT_DEFAULTS | {k: v for k, v in stated.items() if k != "model_type"}
    for field in ("rope_parameters", "rope_scaling"):
        rope = text.get(field)
        if isinstance(rope, dict) and "mrope_section" in rope:
            rope = {k: v for k, v in rope.items() if k != "mrope_section"}
            text["mrope_section"] = text[field]["mrope_section"]
            if rope.get("type", rope.get("rope_type")) == "mrope":
                rope = {k: v for k, v in rope.items() if k not in ("type", "rope_type")}
                rope["rope_type"] = "default"
            text[field] = rope
    if "rope_theta" not in (text.get("rope_parameters") or {}):
        text.setdefault("rope_theta", QWEN_VL_ROPE_THETA_DEFAULT)
    return text


def _gemma3_fields(raw: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's choices: SigLIP's last layer through its post-layernorm, the patch grid pooled to
    `mm_tokens_per_image` rows (a square whose side divides the grid's), bidirectional images."""
    tokens = raw.get("mm_tokens_per_image", GEMMA3_TOKENS_PER_IMAGE_DEFAULT)
    side = math.isqrt(tokens) if isinstance(tokens, int) and tokens > 0 else 0
    grid = vision["image_size"] // vision["patch_size"]
    if side * side != tokens or grid % side:
        raise UnsupportedModelError(f"config.json field 'mm_tokens_per_image' = {tokens!r}: nanoserve pools "
                                    f"the {grid} x {grid} patch grid to a square whose side divides {grid}")
    token = raw.get("image_token_id", raw.get("image_token_index", GEMMA3_IMAGE_TOKEN_DEFAULT))
    return dict(layer_norm_eps=vision.get("layer_norm_eps", 1e-6), image_token_id=token,
                tokens_per_image=tokens, bidirectional=True)


def _llava_fields(raw: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """LLaVA-1.5's choices: one CLIP layer, with or without its class token, an MLP projector."""
    layer = raw.get("vision_feature_layer", -2)
    strategy = raw.get("vision_feature_select_strategy", "default")
    depth = vision["num_hidden_layers"]
    if not isinstance(layer, int) or not -depth - 1 <= layer <= depth:
        raise UnsupportedModelError(f"config.json field 'vision_feature_layer' = {layer!r}: nanoserve reads "
                                    "one layer of the tower")
    if strategy not in ("default", "full"):
        raise UnsupportedModelError(f"config.json field 'vision_feature_select_strategy' = {strategy!r}: "
                                    "'default' or 'full'")
    act = raw.get("projector_hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        raise UnsupportedModelError(f"config.json field 'projector_hidden_act' = {act!r}: nanoserve's "
                                    f"projector runs {', '.join(ENCODER_ACTIVATIONS)}")
    token = raw.get("image_token_id", raw.get("image_token_index", LLAVA_IMAGE_TOKEN_DEFAULT))
    return dict(layer_norm_eps=vision.get("layer_norm_eps", 1e-5), image_token_id=token, feature_layer=layer,
                class_token=True, drop_class_token=strategy == "default", projector_act=act)


def text_config_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config.json fields: a vision-language checkpoint's `text_config` (its text
    family's defaults where it leaves fields out, as transformers fills them: Llama's, Gemma 3's;
    the head tying the whole checkpoint declares), any other checkpoint's own fields."""
    if raw.get("vision_config") is None or raw.get("model_type") not in VISION_FAMILIES:
        return raw
    family = VISION_FAMILIES[raw["model_type"]]
    if family in QWEN_FAMILIES:
        text = _qwen_text(raw)
        if "tie_word_embeddings" in raw:
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        return text
    text = TEXT_DEFAULTS[family] | dict(raw.get("text_config") or {})
    text.setdefault("num_key_value_heads", text["num_attention_heads"])
    if text["model_type"] == "gemma3_text" and "rope_parameters" not in text:
        text.setdefault("rope_theta", GEMMA3_ROPE_THETA_DEFAULT)
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text
