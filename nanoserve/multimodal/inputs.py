"""What the engine knows of an image: a content hash, the pixels its encoder reads, and the
prompt positions its embedding rows fill. Nothing else about images reaches the scheduler,
the runner or the model.

Owns: `ImageInput`, `expand_placeholders` (each placeholder in a prompt's text replaced by its
image's expansion, in order) and `place_images` (each image's run of placeholder token
positions in the token ids, marked bidirectional for a family whose image rows attend to each
other both ways). Refuses: a prompt whose placeholders do not match its images one for one, and
a bidirectional image whose positions are not one run (`check_runs`), naming the field.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.processors import ProcessedImage


@dataclass(slots=True, eq=False)
class ImageInput:
    """One image of one prompt. Row i of its embedding (the encoder's output) goes to prompt
    position `positions[i]`. Until it is encoded it holds its pixels; from then on its rows
    instead (a preempted request recomputes from them), so a long queue of image requests
    holds each image's few rows rather than its pixel tiles. Tensors are untyped here: the
    scheduler, which carries these, has no torch."""

    content_hash: bytes  # sha256 of the processed pixels: the embedding cache's and prefix cache's key
    pixel_values: Any  # [tiles, channels, height, width]; None once encoded
    positions: tuple[int, ...]
    rows: Any = None  # [len(positions), text hidden] once encoded
    # Its rows attend to each other both ways (Gemma 3; its positions then one run): each sees up
    # to the image's last position, so no prompt chunk may end inside it.
    bidirectional: bool = False

    @property
    def last_position(self) -> int:
        return self.positions[-1]

    def key_material(self, start: int, stop: int) -> bytes:
        """Its hash when any of its rows lies in positions [start, stop), else nothing: what a
        prefix-cache block over those positions mixes into its key."""
        first = bisect.bisect_left(self.positions, start)
        return self.content_hash if first < len(self.positions) and self.positions[first] < stop else b""

    def rows_in(self, start: int, stop: int) -> tuple[int, int]:
        """The range [first, last) of its rows whose positions lie in [start, stop)."""
        return bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, stop)


def content_hash(processed: ProcessedImage) -> bytes:
    pixels = processed.pixel_values.contiguous().numpy()
    return hashlib.sha256(repr(pixels.shape).encode() + pixels.tobytes()).digest()


def expand_placeholders(text: str, placeholder: str, images: Sequence[ProcessedImage], field: str) -> str:
    """`text` with its i-th `placeholder` replaced by image i's prompt text."""
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(images):
        raise InvalidRequestError(f"the prompt has {len(pieces) - 1} image placeholders ({placeholder}) for "
                                  f"{len(images)} images: give one per image", param=field)
    expanded = [pieces[0]]
    for image, piece in zip(images, pieces[1:], strict=True):
        expanded += [image.prompt_text, piece]
    return "".join(expanded)


def place_images(prompt_ids: Sequence[int], images: Sequence[ProcessedImage], image_token_id: int,
                 field: str, bidirectional: bool = False) -> list[ImageInput]:
    """Each image's positions: the image tokens of the prompt, the first image's rows first
    (`bidirectional`: each image's rows attend to each other both ways, and must be one run)."""
    positions = [p for p, token in enumerate(prompt_ids) if token == image_token_id]
    wanted = sum(image.num_rows for image in images)
    if len(positions) != wanted:
        raise InvalidRequestError(f"the prompt holds {len(positions)} image tokens where its images need "
                                  f"{wanted} (was it truncated, or does its text hold the image token "
                                  "itself?)", param=field)
    placed, start = [], 0
    for image in images:
        stop = start + image.num_rows
        placed.append(ImageInput(content_hash(image), image.pixel_values, tuple(positions[start:stop]),
                                 bidirectional=bidirectional))
        start = stop
    if bidirectional:
        check_runs(placed, field)
    return placed


def check_runs(images: Sequence[ImageInput], field: str) -> None:
    """Refuse a bidirectional image whose positions are not one run (its text between them would
    see rows after it)."""
    for i, image in enumerate(images):
        if image.positions and image.last_position - image.positions[0] + 1 != len(image.positions):
            raise InvalidRequestError("this model's image rows attend to each other both ways: an image's "
                                      "placeholder tokens must be one run", param=f"{field}[{i}]")
