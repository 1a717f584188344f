"""What a vision-language model is given (`MultiModalConfig`): the limits on a prompt's images
and, for a GGUF text model, the llama.cpp mmproj file that holds its vision tower.

Refuses: decoding or checking an image (`nanoserve.multimodal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.multimodal.limits import ImageLimits


@dataclass(frozen=True, slots=True)
class MultiModalConfig:
    # How many images one prompt may carry and how large each may be (vLLM's limit_mm_per_prompt).
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    # A llama.cpp mmproj GGUF: the vision tower and projector of a text model given as --model.
    mmproj: str | None = None
