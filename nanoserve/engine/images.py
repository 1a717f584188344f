"""The engine's image side: a request's images become token ids with placeholder runs and
`ImageInput`s; an image's embedding rows are computed once and kept by content hash.

Owns: `EngineImages` (the model's processor, its encoder and `ImageEmbeddingCache`): decoding
under the engine's `ImageLimits`, expanding the prompt's placeholders, placing each image's rows,
and encoding on demand (a prefill chunk's first need). Where the text model's vocabulary lacks the
image token (a LLaVA text GGUF's 32,000 Llama tokens), the image rows take an id outside the
vocabulary, never sampled and never embedded (the model looks up id 0 there, then splices the
image's rows over it), and the prompt's text is encoded piece by piece around its placeholders,
as llama.cpp's mtmd encodes it. An image is encoded alone (never batched
with another request's), so its rows have the same bits in a crowd as alone; a preempted
request's recompute reads the rows its image kept, and another request sending the same image
those the cache kept.
Refuses: images placed where the prompt holds no image tokens, and (in `Engine.add_request`)
images for a model without a vision tower or raw images beside a token-id prompt (their
placeholders come from the text), each naming the field.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from PIL import Image

from nanoserve.errors import InvalidRequestError
from nanoserve.loading.mmproj import read_mmproj
from nanoserve.loading.vision import image_encoder, load_image_encoder, read_vision_config
from nanoserve.model.linear import LinearKernel, float_kernel_beside
from nanoserve.model.vision import ImageEncoder
from nanoserve.model.vision_config import QWEN_FAMILIES
from nanoserve.multimodal.images import decode_image, to_rgb
from nanoserve.multimodal.inputs import (
    ImageInput,
    check_runs,
    expand_placeholders,
    place_images,
    splice_placeholder_ids,
    split_at_placeholders,
)
from nanoserve.multimodal.limits import ImageLimits
from nanoserve.multimodal.processors import PROCESSORS, ImageProcessor, ProcessedImage, load_processor

# Images' embedding rows kept for reuse (preemption, a repeated image): the least recently
# used go first past this many bytes.
IMAGE_CACHE_BYTES = 256 << 20

ImageData = bytes | Image.Image
# The token ids of each piece of a prompt's text, the prompt's special tokens around them all
# (`Tokenizer.encode_pieces`), checked.
PieceEncoder = Callable[[list[str]], list[list[int]]]


class ImageEmbeddingCache:
    """Embedding rows by content hash, least recently used evicted past `max_bytes`."""

    def __init__(self, max_bytes: int = IMAGE_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: bytes, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        rows = self._rows.get(key)
        if rows is not None:
            self.hits += 1
            self._rows.move_to_end(key)
            return rows
        self.misses += 1
        rows = compute()
        self._rows[key] = rows
        self.num_bytes += rows.numel() * rows.element_size()
        while self.num_bytes > self.max_bytes and len(self._rows) > 1:
            _, evicted = self._rows.popitem(last=False)
            self.num_bytes -= evicted.numel() * evicted.element_size()
        return rows


class EngineImages:
    def __init__(self, processor: ImageProcessor, encoder: ImageEncoder, limits: ImageLimits,
                 device: torch.device, placeholder_outside_vocab: bool = False) -> None:
        """`placeholder_outside_vocab`: the image token id (the encoder config's) lies outside the
        text model's vocabulary."""
        self.processor = processor
        self.encoder = encoder
        self.limits = limits
        self.device = device
        self.placeholder_outside_vocab = placeholder_outside_vocab
        self.cache = ImageEmbeddingCache()

    @classmethod
    def load(cls, model_dir: Path, limits: ImageLimits, *, dtype: torch.dtype, device: torch.device,
             kernel: LinearKernel, threads: int | None = None, mmproj: Path | None = None,
             token_id: Callable[[str], int | None] | None = None,
             id_outside_vocab: int | None = None) -> EngineImages | None:
        """The image side of `model_dir`, or of the llama.cpp `mmproj` file beside a text model
        (`token_id` then finds its placeholder token in the text model's vocabulary; LLaVA's
        images take `id_outside_vocab` where it has none); None for a text-only model. Its
        matrices run the text model's float kernel (beside a quantized one, `float_kernel_beside`'s:
        the tower stays float), its native calls on `threads` threads."""
        float_kernel = float_kernel_beside(kernel, dtype, device)
        if mmproj is not None:
            return cls._from_mmproj(mmproj, limits, dtype, device, float_kernel, threads, token_id,
                                    id_outside_vocab)
        config = read_vision_config(model_dir)
        if config is None:
            return None
        encoder = load_image_encoder(model_dir, config, dtype=dtype, device=device,
                                     linear_kernel=float_kernel, threads=threads)
        return cls(load_processor(model_dir, config), encoder, limits, device)

    @classmethod
    def _from_mmproj(cls, path: Path, limits: ImageLimits, dtype: torch.dtype, device: torch.device,
                     kernel: LinearKernel, threads: int | None, token_id: Callable[[str], int | None] | None,
                     id_outside_vocab: int | None) -> EngineImages:
        if not path.is_file():
            raise InvalidRequestError(f"mmproj: {path} is not a file", param="mmproj")
        config, weights, fields = read_mmproj(path, token_id or (lambda _: None), id_outside_vocab)
        encoder = image_encoder(config, weights.to(dtype, device), kernel, threads)
        return cls(PROCESSORS[config.family].from_config(fields, config), encoder, limits, device,
                   placeholder_outside_vocab=config.image_token_id == id_outside_vocab)

    def prompt(self, text: str, images: Sequence[ImageData], encode: PieceEncoder,
               truncate: Callable[[list[int]], list[int]],
               field: str = "images") -> tuple[list[int], list[ImageInput]]:
        """The prompt's token ids, its placeholders expanded (an image token outside the vocabulary:
        the text around them encoded piece by piece, the image rows' ids between), and its images
        placed in them."""
        self.limits.check_count(len(images), field)
        processed = [self._processed(image, f"{field}[{i}]") for i, image in enumerate(images)]
        config = self.encoder.config
        placeholder = self.processor.placeholder
        if self.placeholder_outside_vocab:
            pieces = encode(split_at_placeholders(text, placeholder, len(processed), field))
            ids = splice_placeholder_ids(pieces, processed, config.image_token_id)
        else:
            (ids,) = encode([expand_placeholders(text, placeholder, processed, field)])
        ids = truncate(ids)
        return ids, place_images(ids, processed, config.image_token_id, field, config.bidirectional)

    def check_placed(self, prompt_ids: Sequence[int], images: Sequence[ImageInput],
                     field: str = "images") -> None:
        """Refuse images placed where the prompt holds no image tokens (a truncated prompt)."""
        image_token_id = self.encoder.config.image_token_id
        self.limits.check_count(len(images), field)
        for i, image in enumerate(images):
            if any(p >= len(prompt_ids) or prompt_ids[p] != image_token_id for p in image.positions):
                raise InvalidRequestError("an image's rows are placed where the prompt holds no image tokens",
                                          param=f"{field}[{i}]")
            if image.bidirectional != self.encoder.config.bidirectional:
                how = "both ways" if self.encoder.config.bidirectional else "causally"
                raise InvalidRequestError(f"an image placed for another model: this model's image rows "
                                          f"attend {how}", param=f"{field}[{i}]")
            if (image.rope_grid is None) != (self.encoder.config.family not in QWEN_FAMILIES):
                raise InvalidRequestError("an image placed for another model: this model's image rows take "
                                          "M-RoPE grid positions" if image.rope_grid is None else
                                          "an image placed for another model: it carries an M-RoPE grid",
                                          param=f"{field}[{i}]")
        if self.encoder.config.bidirectional or self.encoder.config.family in QWEN_FAMILIES:
            check_runs(images, field)

    def _processed(self, image: ImageData, field: str) -> ProcessedImage:
        """The image decoded and processed; a refusal of its shape (Qwen2-VL's aspect ratio) names `field`."""
        try:
            return self.processor.process(self._decoded(image, field))
        except InvalidRequestError as error:
            error.param = error.param or field
            raise

    def _decoded(self, image: ImageData, field: str) -> Image.Image:
        if isinstance(image, bytes | bytearray):
            return decode_image(bytes(image), field, self.limits)
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"an image must be the bytes of an image file or a PIL image; got "
                                      f"{type(image).__name__}", param=field)
        if image.width * image.height > self.limits.max_pixels:
            raise InvalidRequestError(f"the image is {image.width} x {image.height} pixels; at most "
                                      f"{self.limits.max_pixels} pixels are allowed", param=field)
        return to_rgb(image)

    def embeddings(self, image: ImageInput) -> torch.Tensor:
        """The image's embedding rows [len(positions), text hidden] on the device: encoded once
        (or found by hash: another request's), then kept on the image in place of its pixels."""
        if image.rows is None:
            pixels = image.pixel_values
            image.rows = self.cache.get(image.content_hash,
                                        lambda: self.encoder.encode(pixels.to(self.device)))
            image.pixel_values = None
        return image.rows
