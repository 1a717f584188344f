"""How much image a request may bring: `ImageLimits`, one engine-wide setting (`serve
--limit-mm-per-prompt`, `--max-image-pixels`), checked before an image is decoded or processed."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.errors import InvalidRequestError

# A 4096 x 4096 image: Idefics3's processors shrink anything larger to fit inside this anyway.
MAX_PIXELS_DEFAULT = 4096 * 4096
MAX_BYTES_DEFAULT = 20 << 20
MAX_IMAGES_PER_PROMPT_DEFAULT = 8


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_images_per_prompt: int = MAX_IMAGES_PER_PROMPT_DEFAULT
    max_pixels: int = MAX_PIXELS_DEFAULT  # width * height of one image, as its file says
    max_bytes: int = MAX_BYTES_DEFAULT  # one image's encoded file

    def __post_init__(self) -> None:
        for name in ("max_images_per_prompt", "max_pixels", "max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"{name} must be an integer >= 0; got {value!r}", param=name)

    def check_count(self, count: int, field: str) -> None:
        if count > self.max_images_per_prompt:
            raise InvalidRequestError(f"{count} images in one prompt; at most {self.max_images_per_prompt} "
                                      "are allowed (--limit-mm-per-prompt)", param=field)
