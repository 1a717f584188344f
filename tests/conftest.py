"""Shared fixtures: tiny random checkpoints, the default model, and its golden reference."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import nanoserve  # noqa: F401  (before torch: it shortens torch's OpenMP spin, as the CLI does)
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file
from tiny_model import write_tiny_gguf, write_tiny_llama

from nanoserve.loading.default_model import DEFAULT_DISTRIBUTION, INSTALL_COMMAND, resolve_model_dir

# CI runs .ci/run in a fresh clone of the repository with a copy of shared/ beside it: the
# clone's parent directory holds shared/. Without it the tests that need the reference skip,
# naming the path they looked at.
REFERENCE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "smollm2"


@dataclass(frozen=True)
class Reference:
    """Golden outputs for the default model (see README.md in `root`)."""

    root: Path
    prompts: list[Any]  # a string (completion) or {"messages": [...]} (chat)
    cases: list[dict[str, Any]]  # prompt_ids, rendered, greedy_ids, greedy_text, top-10
    logits: dict[str, torch.Tensor]  # last_logits_<i> [vocab]; all_logits_0 [positions, vocab]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_tied"))


@pytest.fixture(scope="session")
def tiny_model_dir_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_untied"), tie_word_embeddings=False)


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory) -> Path:
    """12 heads (tensor parallelism at N = 2, 3, 4 divides them), every matrix's input a whole
    number of 256-value blocks (the K-quants')."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_wide"), num_heads=12, num_kv_heads=12,
                            hidden_size=768, intermediate_size=768)


@pytest.fixture(scope="session")
def wide_gguf(wide_model_dir, tmp_path_factory) -> Callable[[str], Path]:
    """`wide_gguf("Q4_1")`: the wide model as a GGUF of that block type, written once."""
    made: dict[str, Path] = {}

    def gguf(block_type: str) -> Path:
        if block_type not in made:
            path = tmp_path_factory.mktemp("gguf") / f"tiny-wide-{block_type}.gguf"
            made[block_type] = write_tiny_gguf(path, wide_model_dir,
                                               matrix_type=GGMLQuantizationType[block_type])
        return made[block_type]

    return gguf


@pytest.fixture(scope="session")
def reference() -> Reference:
    if not (REFERENCE_DIR / "reference.json").is_file():
        pytest.skip(f"no reference outputs at {REFERENCE_DIR} (shared/ beside the clone)")
    return Reference(
        root=REFERENCE_DIR,
        prompts=json.loads((REFERENCE_DIR / "prompts.json").read_text(encoding="utf-8")),
        cases=json.loads((REFERENCE_DIR / "reference.json").read_text(encoding="utf-8"))["cases"],
        logits=load_file(REFERENCE_DIR / "logits.safetensors"),
    )


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted into the cache (seconds the first time, then instant)."""
    try:
        metadata.distribution(DEFAULT_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.skip(f"the default model is not installed: {INSTALL_COMMAND}")
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def default_llm(default_model_dir):
    """The default model in float32 with the default engine (batch-invariant, prefix caching, 32
    sequences), loaded once for every module that only runs requests through it. A test that
    needs other engine settings builds its own."""
    from nanoserve.llm import LLM

    llm = LLM(str(default_model_dir), device="cpu", kv_cache_gb=0.25)
    assert llm.engine.dtype == torch.float32 and llm.engine.config.batch_invariant
    return llm
