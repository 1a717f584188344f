"""Hub ids as `--model`: resolved from a hub cache laid out here, with the network refused."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants
from tiny_model import write_tiny_gguf
from typer.testing import CliRunner

from nanoserve.errors import ModelNotFoundError
from nanoserve.loading import default_model
from nanoserve.loading.default_model import resolve_model_dir
from nanoserve.loading.hub import HubId, parse_hub_id
from nanoserve_cli.main import app

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def lay_out_hub_repo(cache: Path, repo_id: str, files: list[Path], *, commit: str = COMMIT,
                     ref: str = "main") -> Path:
    """What huggingface_hub leaves after a download: models--ORG--NAME/{refs,snapshots}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in files:
        shutil.copy(file, snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An offline hub cache in tmp_path; any socket connection fails the test."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    # huggingface_hub reads these variables once, at import; the module values are what it uses.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "nanoserve"))

    def refuse(*args: object) -> None:
        raise AssertionError("touched the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return cache


@pytest.fixture
def tiny_snapshot(hub_cache, tiny_model_dir) -> Path:
    return lay_out_hub_repo(hub_cache, "org/tiny", sorted(tiny_model_dir.iterdir()))


@pytest.fixture
def gguf_repo(hub_cache, tiny_model_dir, tmp_path) -> Path:
    built = tmp_path / "built"
    built.mkdir()
    files = [write_tiny_gguf(built / name, tiny_model_dir) for name in ("tiny-Q8_0.gguf", "tiny-F32.gguf")]
    return lay_out_hub_repo(hub_cache, "org/tiny-GGUF", files)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", HubId("HuggingFaceTB/SmolLM2-135M-Instruct",
                                                      "HuggingFaceTB/SmolLM2-135M-Instruct")),
        ("org/name@v1.0", HubId("org/name@v1.0", "org/name", "v1.0")),
        ("org/name:Q4_K_M", HubId("org/name:Q4_K_M", "org/name", None, "Q4_K_M")),
        ("org/name@main:model.Q8_0.gguf", HubId("org/name@main:model.Q8_0.gguf", "org/name", "main",
                                                 "model.Q8_0.gguf")),
    ],
)
def test_hub_ids_parse_into_repo_revision_and_file(text, expected):
    assert parse_hub_id(text) == expected


@pytest.mark.parametrize("text", ["/abs/org/name", "./org/name", "~/org/name", "a/b/c", "model.gguf", "org/"])
def test_paths_are_not_hub_ids(text):
    assert parse_hub_id(text) is None


def test_cached_hub_id_resolves_to_its_snapshot_without_the_network(tiny_snapshot):
    assert resolve_model_dir("org/tiny") == tiny_snapshot
    assert resolve_model_dir(f"org/tiny@{COMMIT}") == tiny_snapshot


def test_revision_after_at_picks_that_snapshot(hub_cache, tiny_snapshot, tiny_model_dir):
    tagged = lay_out_hub_repo(hub_cache, "org/tiny", sorted(tiny_model_dir.iterdir()),
                              commit=OTHER_COMMIT, ref="v2")
    assert resolve_model_dir("org/tiny@v2") == tagged
    assert resolve_model_dir("org/tiny") == tiny_snapshot


def test_llm_generates_from_a_cached_hub_id(tiny_snapshot):
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    llm = LLM("org/tiny")
    assert llm.engine.model_dir == tiny_snapshot
    completion = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(completion.token_ids) == 4


def test_local_directory_wins_over_a_hub_id_of_the_same_spelling(tiny_snapshot, tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    shutil.copytree(tiny_model_dir, tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)

    def refuse(hub_id: HubId) -> Path:
        raise AssertionError(f"looked up {hub_id.text} on the hub")

    monkeypatch.setattr(default_model, "fetch_checkpoint", refuse)
    assert resolve_model_dir("org/tiny") == Path("org/tiny")


def test_uncached_id_offline_names_the_id_and_the_fix(hub_cache):
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_dir("org/missing")
    message = str(caught.value)
    assert "org/missing" in message and "HF_HUB_OFFLINE" in message and str(hub_cache) in message


def test_cli_generates_from_a_hub_id_and_exits_2_for_a_missing_one(tiny_snapshot):
    runner = CliRunner()
    found = runner.invoke(app, ["generate", "hello", "--model", "org/tiny", "--max-tokens", "3"])
    assert found.exit_code == 0, found.output
    missing = runner.invoke(app, ["generate", "hello", "--model", "org/missing", "--max-tokens", "3"])
    assert missing.exit_code == 2, missing.output
    assert "org/missing" in missing.output and "Traceback" not in missing.output


def test_gguf_repository_by_file_name_and_by_quant_name(gguf_repo):
    by_file = resolve_model_dir("org/tiny-GGUF:tiny-F32.gguf")
    by_quant = resolve_model_dir("org/tiny-GGUF:q8_0")
    assert (by_file / "config.json").is_file() and (by_quant / "config.json").is_file()
    assert by_file != by_quant


def test_gguf_repository_without_a_file_choice_says_how_to_make_one(gguf_repo):
    with pytest.raises(ModelNotFoundError, match=r"org/tiny-GGUF:FILE\.gguf"):
        resolve_model_dir("org/tiny-GGUF")


def test_quant_name_matching_no_file_lists_the_files(gguf_repo):
    with pytest.raises(ModelNotFoundError, match="Q2_K") as caught:
        resolve_model_dir("org/tiny-GGUF:Q2_K")
    assert "tiny-F32.gguf" in str(caught.value) and "tiny-Q8_0.gguf" in str(caught.value)


def test_missing_gguf_file_names_it(gguf_repo):
    with pytest.raises(ModelNotFoundError, match=r"tiny-Q4_0\.gguf"):
        resolve_model_dir("org/tiny-GGUF:tiny-Q4_0.gguf")


def test_a_fresh_process_finds_the_cache_through_hf_home_and_stays_offline(tiny_model_dir, tmp_path):
    """The variables as a user sets them, read by huggingface_hub at start-up: HF_HOME names
    the cache (HF_HOME/hub) and HF_HUB_OFFLINE=1 keeps the process off the network."""
    lay_out_hub_repo(tmp_path / "hf" / "hub", "org/tiny", sorted(tiny_model_dir.iterdir()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "NANOSERVE_CACHE": str(tmp_path / "ns")}
    cmd = [sys.executable, "-m", "nanoserve", "generate", "hello", "--model", "org/tiny", "--max-tokens", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
