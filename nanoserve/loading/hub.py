"""Hugging Face hub ids: `ORG/NAME[@REVISION][:FILE.gguf | :QUANT]` as files on disk.

Owns: telling a hub id from other text, fetching only what the engine reads (config,
safetensors, tokenizer files; or one .gguf file) through huggingface_hub, which honors
HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN itself, and turning its errors into one
ModelNotFoundError that names the id and the fix.
Refuses: deciding that a string is a hub id rather than a local path (default_model checks the
disk first) and converting GGUF files (default_model does, once, into its own cache).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, hf_hub_download, list_repo_files, snapshot_download
from huggingface_hub.utils import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from nanoserve.errors import ModelNotFoundError

CHECKPOINT_FILES = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
]
_NAME = r"[A-Za-z0-9_][\w.-]*"
_HUB_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[^:@]+))?(?::(?P<file>[\w.-]+))?")


@dataclass(frozen=True, slots=True)
class HubId:
    """A parsed hub id; `file` is a .gguf file name or a quant name such as Q4_K_M."""

    text: str
    repo_id: str
    revision: str | None = None
    file: str | None = None


def parse_hub_id(text: str) -> HubId | None:
    """The hub id `text` spells, or None when it cannot be one."""
    match = _HUB_ID.fullmatch(text)
    if match is None:
        return None
    return HubId(text, match["repo"], match["revision"], match["file"])


def fetch_checkpoint(hub_id: HubId) -> Path:
    """The snapshot directory holding the checkpoint files of `hub_id`."""
    with _explained(hub_id):
        snapshot = Path(snapshot_download(hub_id.repo_id, revision=hub_id.revision,
                                          allow_patterns=CHECKPOINT_FILES, local_files_only=_offline()))
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(
            f"{hub_id.text} has no config.json; a GGUF repository needs a file choice: "
            f"{hub_id.text}:FILE.gguf, or a quant name such as {hub_id.text}:Q4_K_M"
        )
    return snapshot


def fetch_gguf(hub_id: HubId) -> Path:
    """The .gguf file that `hub_id`'s file choice names, downloaded unless cached."""
    choice = hub_id.file or ""
    file_name = choice if choice.endswith(".gguf") else _quant_file(hub_id, choice)
    with _explained(hub_id):
        return Path(hf_hub_download(hub_id.repo_id, file_name, revision=hub_id.revision,
                                    local_files_only=_offline()))


def _quant_file(hub_id: HubId, quant: str) -> str:
    """The .gguf file whose name contains `quant` (any case), as llama.cpp's `-hf` picks it."""
    matches = [name for name in _gguf_files(hub_id) if quant.lower() in Path(name).name.lower()]
    if len(matches) == 1:
        return matches[0]
    choices = ", ".join(matches or _gguf_files(hub_id)) or "none"
    what = "several .gguf files match" if matches else "no .gguf file matches"
    raise ModelNotFoundError(f"{hub_id.text}: {what} {quant!r}; name one as {hub_id.repo_id}:FILE.gguf "
                             f"(.gguf files: {choices})")


def _gguf_files(hub_id: HubId) -> list[str]:
    with _explained(hub_id):
        if not _offline():
            return sorted(f for f in list_repo_files(hub_id.repo_id, revision=hub_id.revision)
                          if f.endswith(".gguf"))
        # Offline the hub cannot list the repository; the cached snapshot is what there is.
        snapshot = Path(snapshot_download(hub_id.repo_id, revision=hub_id.revision,
                                          allow_patterns=["*.gguf"], local_files_only=True))
    return sorted(str(path.relative_to(snapshot)) for path in snapshot.rglob("*.gguf"))


def _offline() -> bool:
    return constants.HF_HUB_OFFLINE


@contextlib.contextmanager
def _explained(hub_id: HubId) -> Iterator[None]:
    """Re-raises huggingface_hub's errors as one ModelNotFoundError naming the id and the fix."""
    try:
        yield
    except (EntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError) as error:
        raise ModelNotFoundError(_explanation(hub_id, error)) from error


def _explanation(hub_id: HubId, error: Exception) -> str:
    text, repo = hub_id.text, hub_id.repo_id
    # The order matters: gated is a kind of not-found, and a local miss a kind of missing entry.
    if isinstance(error, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        why = "HF_HUB_OFFLINE is set" if _offline() else "the hub cannot be reached"
        return (f"{text} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; "
                f"download it once online (HF_HUB_OFFLINE unset), or pass a local directory or .gguf file")
    if isinstance(error, GatedRepoError):
        return (f"{text} is gated: accept its terms at https://huggingface.co/{repo} and set HF_TOKEN "
                f"to a token of that account")
    if isinstance(error, RepositoryNotFoundError):
        return (f"{text}: no model repository {repo} on the Hugging Face hub; check the spelling, "
                f"or set HF_TOKEN if it is private")
    if isinstance(error, RevisionNotFoundError):
        return f"{text}: {repo} has no revision {hub_id.revision!r}; check the part after @"
    if isinstance(error, EntryNotFoundError):
        return f"{text}: {repo} has no file {hub_id.file!r}; check the part after :"
    return f"{text}: the Hugging Face hub refused the download ({error}); try again, or check HF_TOKEN"
