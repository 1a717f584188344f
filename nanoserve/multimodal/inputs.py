"""What the engine knows of an image: a content hash, the pixels its encoder reads, and the
prompt positions its embedding rows fill. Nothing else about images reaches the scheduler,
the runner or the model.

Owns: `ImageInput`, `expand_placeholders` (each placeholder in a prompt's text replaced by its
image's expansion, in order), `splice_placeholder_ids` (the token ids of the text between the
placeholders with each image's run of placeholder ids between them, where the vocabulary has no
placeholder token), `rope_positions` (M-RoPE's three positions of a prompt's tokens)
and `place_images` (each image's run of placeholder token
positions in the token ids, marked bidirectional for a family whose image rows attend to each
other both ways). Refuses: a prompt whose placeholders do not match its images one for one, and
a bidirectional or M-RoPE image whose positions are not one run (`check_runs`), naming the field.
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
    # M-RoPE (Qwen2-VL): its rows' (temporal, height, width) grid; its positions then one run
    # (`rope_positions`). None: its rows take their token positions, as text does.
    rope_grid: tuple[int, int, int] | None = None

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


def split_at_placeholders(text: str, placeholder: str, num_images: int, field: str) -> list[str]:
    """The pieces of `text` around its placeholders, one placeholder per image."""
    pieces = text.split(placeholder)
    if len(pieces) - 1 != num_images:
        raise InvalidRequestError(f"the prompt has {len(pieces) - 1} image placeholders ({placeholder}) for "
                                  f"{num_images} images: give one per image", param=field)
    return pieces


def expand_placeholders(text: str, placeholder: str, images: Sequence[ProcessedImage], field: str) -> str:
    """`text` with its i-th `placeholder` replaced by image i's prompt text."""
    pieces = split_at_placeholders(text, placeholder, len(images), field)
    expanded = [pieces[0]]
    for image, piece in zip(images, pieces[1:], strict=True):
        expanded += [image.prompt_text, piece]
    return "".join(expanded)


def splice_placeholder_ids(piece_ids: Sequence[list[int]], images: Sequence[ProcessedImage],
                           placeholder_id: int) -> list[int]:
    """The token ids of the pieces of a prompt's text around its placeholders, with image i's rows
    (`num_rows` of `placeholder_id`) between piece i and piece i + 1: llama.cpp's mtmd_tokenize,
    for a family whose image expands to its rows alone (LLaVA's)."""
    ids = list(piece_ids[0])
    for image, piece in zip(images, piece_ids[1:], strict=True):
        ids += [placeholder_id] * image.num_rows
        ids += piece
    return ids


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
                                 bidirectional=bidirectional, rope_grid=image.rope_grid))
        start = stop
    if bidirectional or any(image.rope_grid for image in placed):
        check_runs(placed, field)
    return placed


def rope_positions(images: Sequence[ImageInput], start: int, stop: int) -> list[list[int]]:
    """M-RoPE's (temporal, height, width) positions of a prompt's positions [start, stop), as
    transformers' get_rope_index gives them: text takes its token position on all three, shifted
    by the images before it; an image's rows its grid's (t, h, w) from where its text left off;
    the text after an image continues from that image's largest position + 1 (generated tokens
    too: position p of a request whose images all lie before it is p + their shift on all three)."""
    axes: list[list[int]] = [[], [], []]
    shift, cursor = 0, start

    def text(first: int, last: int) -> None:
        for axis in axes:
            axis.extend(range(first + shift, last + shift))

    for image in images:
        first, count = image.positions[0], len(image.positions)
        if first >= stop:
            break
        if cursor < first:
            text(cursor, first)
        _, height, width = image.rope_grid
        begin = first + shift
        for row in range(max(first, start) - first, min(first + count, stop) - first):
            axes[0].append(begin + row // (height * width))
            axes[1].append(begin + row // width % height)
            axes[2].append(begin + row % width)
        shift += max(height, width) - count
        cursor = max(cursor, first + count)
    if cursor < stop:
        text(cursor, stop)
    return axes


def check_runs(images: Sequence[ImageInput], field: str) -> None:
    """Refuse a bidirectional or M-RoPE image whose positions are not one run (its text between them would
    see rows after it)."""
    for i, image in enumerate(images):
        if image.positions and image.last_position - image.positions[0] + 1 != len(image.positions):
            raise InvalidRequestError("this model reads an image's rows as one block (they attend both ways, "
                                      "or take a grid of positions): an image's placeholder tokens must be "
                                      "one run", param=f"{field}[{i}]")
