"""An embedding checkpoint's own pooling method, as sentence-transformers writes it beside the
weights: `modules.json` names a `sentence_transformers.models.Pooling` module whose folder's
`config.json` sets one `pooling_mode_*` flag (Qwen3-Embedding: `pooling_mode_lasttoken`).

Owns reading that choice (vLLM reads the same files). Refuses a mode the engine does not pool by
(CLS, max, weighted mean): an embedding model run with another pooling computes vectors its
training never saw.
"""

from __future__ import annotations

import json
from pathlib import Path

from nanoserve.errors import UnsupportedModelError

POOLING_MODULE = "sentence_transformers.models.Pooling"
MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def checkpoint_pooling(model_dir: Path) -> str | None:
    """The pooling method the checkpoint names; None when it names none."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = json.loads(modules_path.read_text())
    folder = next((m.get("path", "") for m in modules if m.get("type") == POOLING_MODULE), None)
    config_path = model_dir / folder / "config.json" if folder is not None else None
    if config_path is None or not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    chosen = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value is True)
    methods = {MODES.get(key) for key in chosen}
    if len(chosen) != 1 or None in methods:
        raise UnsupportedModelError(
            f"{config_path}: pooling modes {chosen} are not supported; nanoserve pools by exactly one of "
            f"{', '.join(MODES)} (start with --pooling to choose one anyway)")
    return methods.pop()
