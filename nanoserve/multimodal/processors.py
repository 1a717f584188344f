"""Each vision family's image processor: an RGB image to the pixel tiles its encoder reads, and
the text its placeholder in the prompt expands to, as the model's Hugging Face processor does.

Owns: `ImageProcessor` (the interface), `ProcessedImage`, LLaVA-1.5's processor (pad to square
where asked, shortest edge resized, centre crop, rescale, normalise; `<image>` once per row),
Gemma 3's (resized to the tower's square, rescale, normalise; `<start_of_image>` expanded),
Qwen2-VL / Qwen2.5-VL's (smart_resize to multiples of the merged patch, rescale, normalise,
patches in merge-window order, each image's M-RoPE grid; `<|image_pad|>` expanded),
and Idefics3 / SmolVLM's processor,
configured from the checkpoint's preprocessor_config.json: resize so the longest edge is
`size.longest_edge` (at most 4096), then to multiples of `max_image_size.longest_edge`, split
into that many square tiles row by row plus the whole image shrunk to one tile, rescale and
normalise; its prompt text `<fake_token_around_image><row_r_col_c><image>*n ...
<fake_token_around_image><global-img><image>*n<fake_token_around_image>` (the same arithmetic
as transformers' `Idefics3ImageProcessorPil` and `Idefics3Processor`, in numpy and Pillow).
Refuses: decoding (multimodal.images) and knowing where the rows go in a batch (the engine).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from nanoserve.errors import InvalidRequestError, UnsupportedModelError
from nanoserve.model.vision_config import VisionConfig

# transformers' Idefics3 processors never go past a 4096-pixel edge.
IDEFICS3_MAX_EDGE = 4096
IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [tiles, channels, height, width] float32 (Qwen: [grid_h, grid_w, patch])
    prompt_text: str  # what one placeholder in the prompt becomes for this image
    num_rows: int  # embedding rows the encoder makes of it (image tokens in `prompt_text`)
    # M-RoPE (Qwen2-VL): its rows' (temporal, height, width) grid in the text model's positions;
    # None: its rows take one position each, as text does.
    rope_grid: tuple[int, int, int] | None = None


class ImageProcessor(Protocol):
    placeholder: str  # the text marking where an image goes in a prompt, before expansion

    def process(self, image: Image.Image) -> ProcessedImage: ...


def _rescale_to_longest(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' `_resize_output_size_rescale_to_max_len`: the longest edge to `longest`,
    the other kept to the aspect ratio and rounded up to even."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _shrink_below(height: int, width: int, most: int) -> tuple[int, int]:
    """transformers' `_resize_output_size_scale_below_upper_bound`."""
    aspect = width / height
    if width >= height and width > most:
        width, height = most, int(most / aspect)
    elif height > width and height > most:
        height, width = most, int(most * aspect)
    return max(height, 1), max(width, 1)


def _to_tile_multiples(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' `resize_for_vision_encoder`: both edges up to multiples of `tile`."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass(frozen=True, slots=True)
class PixelNormalization:
    """The rescale and normalise every family's processor ends with, as its
    preprocessor_config.json asks (`do_rescale`, `rescale_factor`, `do_normalize`, `image_mean`,
    `image_std`); `None` where a step is off."""

    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_config(cls, raw: dict[str, Any], mean: tuple[float, ...],
                    std: tuple[float, ...]) -> PixelNormalization:
        """`mean` and `std`: the family's defaults where the config names none."""
        normalize = raw.get("do_normalize", True)
        return cls(rescale_factor=raw.get("rescale_factor", 1 / 255) if raw.get("do_rescale", True) else None,
                   mean=tuple(raw.get("image_mean", mean)) if normalize else None,
                   std=tuple(raw.get("image_std", std)) if normalize else None)

    def normalized(self, image: Image.Image) -> np.ndarray:
        """[channels, height, width] float32, rescaled in float64 then normalised in float32 as
        transformers' numpy transforms do."""
        pixels = np.moveaxis(np.asarray(image), -1, 0)
        if self.rescale_factor is not None:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.mean is not None:
            pixels = ((pixels.T - np.array(self.mean, dtype=np.float32))
                      / np.array(self.std, dtype=np.float32)).T
        return np.ascontiguousarray(pixels)

    def pixel_values(self, tiles: list[Image.Image]) -> torch.Tensor:
        """An image's tiles, each `normalized`, as the encoder reads them: [tiles, channels,
        height, width] float32."""
        return torch.from_numpy(np.stack([self.normalized(tile) for tile in tiles]))


@dataclass(frozen=True, slots=True)
class Idefics3Processor:
    rows_per_tile: int  # image tokens per tile (the processor's image_seq_len)
    tile: int  # max_image_size.longest_edge
    longest_edge: int | None  # size.longest_edge; None: no first resize
    split: bool
    resample: int
    normalization: PixelNormalization
    placeholder: str = "<image>"

    @classmethod
    def from_config(cls, raw: dict[str, Any], vision: VisionConfig) -> Idefics3Processor:
        tile = raw.get("max_image_size", {}).get("longest_edge", vision.image_size)
        size = raw.get("size", {"longest_edge": 4 * tile})
        if raw.get("do_resize", True) and "longest_edge" not in size:
            raise UnsupportedModelError(f"preprocessor_config.json field 'size' = {size!r}: Idefics3 "
                                        "resizes by 'longest_edge'")
        return cls(rows_per_tile=vision.rows_per_tile, tile=tile,
                   longest_edge=size["longest_edge"] if raw.get("do_resize", True) else None,
                   split=raw.get("do_image_splitting", True), resample=raw.get("resample", Image.LANCZOS),
                   normalization=PixelNormalization.from_config(raw, IMAGENET_STANDARD, IMAGENET_STANDARD))

    def process(self, image: Image.Image) -> ProcessedImage:
        if self.longest_edge is not None:
            height, width = _rescale_to_longest(image.height, image.width, self.longest_edge)
            image = self._resize(image, *_shrink_below(height, width, IDEFICS3_MAX_EDGE))
        if self.split:
            image = self._resize(image, *_to_tile_multiples(image.height, image.width, self.tile))
            tiles, rows, cols = self._split(image)
        else:
            tiles, rows, cols = [self._resize(image, self.tile, self.tile)], 0, 0
        pixels = self.normalization.pixel_values(tiles)
        return ProcessedImage(pixels, self._prompt_text(rows, cols), len(tiles) * self.rows_per_tile)

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        return image.resize((width, height), resample=self.resample)

    def _split(self, image: Image.Image) -> tuple[list[Image.Image], int, int]:
        """Square tiles row by row, then the whole image as one tile; or the image alone when it
        is one tile already."""
        side = self.tile
        if image.height <= side and image.width <= side:
            return [image], 0, 0
        rows, cols = (image.height - side) // side + 1, (image.width - side) // side + 1
        tiles = [image.crop((c * side, r * side, (c + 1) * side, (r + 1) * side))
                 for r in range(rows) for c in range(cols)]
        return [*tiles, self._resize(image, side, side)], rows, cols

    def _prompt_text(self, rows: int, cols: int) -> str:
        image_tokens = "<image>" * self.rows_per_tile
        whole = f"<fake_token_around_image><global-img>{image_tokens}<fake_token_around_image>"
        if rows == 0 and cols == 0:
            return whole
        text = ""
        for r in range(rows):
            text += "".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{image_tokens}"
                            for c in range(cols))
            text += "\n"
        return text + "\n" + whole


OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class LlavaProcessor:
    """LLaVA-1.5's: optionally padded to a square of the mean colour, the shortest edge resized,
    a centre crop of the tower's image size, rescaled and normalised; one `<image>` per row."""

    rows: int  # image tokens one image becomes
    shortest_edge: int | None  # None: no resize
    crop: int | None  # the centre crop's side (the tower's image_size); None: no crop
    pad_to_square: bool
    resample: int
    normalization: PixelNormalization
    placeholder: str = "<image>"

    @classmethod
    def from_config(cls, raw: dict[str, Any], vision: VisionConfig) -> LlavaProcessor:
        size = raw.get("size", {"shortest_edge": vision.image_size})
        crop = raw.get("crop_size", {"height": vision.image_size, "width": vision.image_size})
        resize, center_crop = raw.get("do_resize", True), raw.get("do_center_crop", True)
        tower_square = {"height": vision.image_size, "width": vision.image_size}
        if (resize and "shortest_edge" not in size) or (center_crop and crop != tower_square):
            raise UnsupportedModelError("preprocessor_config.json: LLaVA's images are resized by "
                                        "'size.shortest_edge' and centre-cropped to the tower's image_size")
        if resize and center_crop and size["shortest_edge"] < vision.image_size:
            raise UnsupportedModelError("preprocessor_config.json: size.shortest_edge is smaller than the "
                                        "crop")
        return cls(rows=vision.rows_per_tile, shortest_edge=size["shortest_edge"] if resize else None,
                   crop=vision.image_size if center_crop else None, pad_to_square=raw.get("do_pad", False),
                   resample=raw.get("resample", Image.BICUBIC),
                   normalization=PixelNormalization.from_config(raw, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))

    def process(self, image: Image.Image) -> ProcessedImage:
        if self.pad_to_square and image.width != image.height:
            side = max(image.width, image.height)
            mean = self.normalization.mean
            colour = tuple(int(x * 255) for x in mean) if mean else (0, 0, 0)
            square = Image.new("RGB", (side, side), colour)
            square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image = square
        if self.shortest_edge is not None:
            short, long = sorted((image.width, image.height))
            new_long = int(self.shortest_edge * long / short)
            width, height = ((self.shortest_edge, new_long) if image.width <= image.height
                             else (new_long, self.shortest_edge))
            image = image.resize((width, height), resample=self.resample)
        if self.crop is not None:
            top, left = (image.height - self.crop) // 2, (image.width - self.crop) // 2
            image = image.crop((left, top, left + self.crop, top + self.crop))
        pixels = self.normalization.pixel_values([image])
        return ProcessedImage(pixels, self.placeholder * self.rows, self.rows)


# Gemma 3's tokenizer's boi_token, image_token and eoi_token (tokenizer_config's extra_special_tokens)
GEMMA3_BOI, GEMMA3_IMAGE, GEMMA3_EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


@dataclass(frozen=True, slots=True)
class Gemma3Processor:
    """Gemma 3's: the image resized to the tower's square (no crops: pan-and-scan is refused),
    rescaled and normalised; its `<start_of_image>` in the prompt becomes
    `\n\n<start_of_image>` + `<image_soft_token>` * rows + `<end_of_image>\n\n`
    (transformers' Gemma3ImageProcessorPil and Gemma3Processor)."""

    rows: int  # image tokens one image becomes (mm_tokens_per_image)
    side: int  # every image is resized to side x side pixels (the tower's image_size)
    resample: int
    normalization: PixelNormalization
    placeholder: str = GEMMA3_BOI

    @classmethod
    def from_config(cls, raw: dict[str, Any], vision: VisionConfig) -> Gemma3Processor:
        if raw.get("do_pan_and_scan"):
            raise UnsupportedModelError("preprocessor_config.json field 'do_pan_and_scan' = true: nanoserve "
                                        "runs Gemma 3's images whole, without pan-and-scan crops")
        square = {"height": vision.image_size, "width": vision.image_size}
        size = raw.get("size", square)
        if not raw.get("do_resize", True) or size != square:
            raise UnsupportedModelError(f"preprocessor_config.json fields 'do_resize' / 'size' = {size!r}: "
                                        f"Gemma 3's images are resized to the tower's {vision.image_size} x "
                                        f"{vision.image_size}")
        return cls(rows=vision.rows_per_tile, side=vision.image_size,
                   resample=raw.get("resample", Image.BILINEAR),
                   normalization=PixelNormalization.from_config(raw, IMAGENET_STANDARD, IMAGENET_STANDARD))

    def process(self, image: Image.Image) -> ProcessedImage:
        image = image.resize((self.side, self.side), resample=self.resample)
        pixels = self.normalization.pixel_values([image])
        text = f"\n\n{GEMMA3_BOI}{GEMMA3_IMAGE * self.rows}{GEMMA3_EOI}\n\n"
        return ProcessedImage(pixels, text, self.rows)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize`: both edges to multiples of `factor`, the area
    within [min_pixels, max_pixels], the aspect ratio kept as near as that allows."""
    if max(height, width) / min(height, width) > QWEN_MAX_ASPECT:
        raise InvalidRequestError(f"the image is {width} x {height} pixels: this model takes images whose "
                                  f"long edge is at most {QWEN_MAX_ASPECT} times the short one", param=None)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


QWEN_MAX_ASPECT = 200  # smart_resize refuses a longer image
QWEN_VISION_START, QWEN_IMAGE_PAD, QWEN_VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


@dataclass(frozen=True, slots=True)
class QwenVLProcessor:
    """Qwen2-VL's and Qwen2.5-VL's: resized by `smart_resize` to multiples of patch * merge
    pixels, rescaled, normalised, and cut into patches in the merge-window order the tower
    reads, each patch repeated over `temporal` frames ([grid_h, grid_w, channels * temporal *
    patch * patch]: transformers' pixel_values rows, the grid kept in the shape); its
    `<|vision_start|><|image_pad|><|vision_end|>` in the prompt gets one `<|image_pad|>` per merged
    row (transformers' Qwen2VLImageProcessorPil and Qwen2VLProcessor)."""

    patch: int
    merge: int
    temporal: int
    min_pixels: int
    max_pixels: int
    resample: int
    normalization: PixelNormalization
    placeholder: str = QWEN_VISION_START + QWEN_IMAGE_PAD + QWEN_VISION_END

    @classmethod
    def from_config(cls, raw: dict[str, Any], vision: VisionConfig) -> QwenVLProcessor:
        size = raw.get("size") or {}
        # transformers reads the bounds from min_pixels / max_pixels over size's (either spelling)
        shortest = raw.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", 56 * 56)))
        longest = raw.get("max_pixels", size.get("longest_edge", size.get("max_pixels", 28 * 28 * 1280)))
        if not raw.get("do_resize", True):
            raise UnsupportedModelError("preprocessor_config.json field 'do_resize' = false: Qwen2-VL's "
                                        "images are resized to multiples of patch_size * merge_size")
        for field, value in (("patch_size", vision.patch_size), ("merge_size", vision.merge_size),
                             ("temporal_patch_size", vision.temporal_patch_size)):
            if raw.get(field, value) != value:
                raise UnsupportedModelError(f"preprocessor_config.json field {field!r} = {raw[field]!r}: the "
                                            f"tower's is {value}")
        return cls(patch=vision.patch_size, merge=vision.merge_size, temporal=vision.temporal_patch_size,
                   min_pixels=shortest, max_pixels=longest, resample=raw.get("resample", Image.BICUBIC),
                   normalization=PixelNormalization.from_config(raw, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))

    def process(self, image: Image.Image) -> ProcessedImage:
        height, width = smart_resize(image.height, image.width, self.patch * self.merge, self.min_pixels,
                                     self.max_pixels)
        image = image.resize((width, height), resample=self.resample)
        pixels = self.normalization.normalized(image)
        channels, p, m = pixels.shape[0], self.patch, self.merge
        grid_h, grid_w = height // p, width // p
        patches = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], self.temporal, p, p))
        rows = grid_h * grid_w // m ** 2
        text = QWEN_VISION_START + QWEN_IMAGE_PAD * rows + QWEN_VISION_END
        # Rows in merge-window order (transformers'); shaped [grid_h, grid_w, ...] only so the
        # grid travels with the pixels (row r * grid_w + c is not patch (r, c)).
        values = torch.from_numpy(np.ascontiguousarray(patches).reshape(grid_h, grid_w, -1))
        return ProcessedImage(values, text, rows, rope_grid=(1, grid_h // m, grid_w // m))


PROCESSORS = {"idefics3": Idefics3Processor, "llava": LlavaProcessor, "gemma3": Gemma3Processor,
              "qwen2_vl": QwenVLProcessor, "qwen2_5_vl": QwenVLProcessor}


def load_processor(model_dir: Path, vision: VisionConfig) -> ImageProcessor:
    """The family's processor, configured by `model_dir`'s preprocessor_config.json."""
    path = model_dir / "preprocessor_config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return PROCESSORS[vision.family].from_config(raw, vision)
