"""GGUF import: a tiny llama written the llama.cpp way comes back as the exact HF checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny_model import CORPUS, llama_cpp_permute, read_weights, write_tiny_gguf, write_tiny_llama
from tokenizers import Tokenizer

from nanoserve.errors import ModelNotFoundError, UnsupportedModelError
from nanoserve.gguf_import import convert_gguf, hf_tensor_shapes, unpermute_qk

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _round_trip(hf_dir: Path, tmp_path: Path) -> Path:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", hf_dir)
    return convert_gguf(gguf_path, tmp_path / "imported")


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_model_dir_untied"])
def test_import_recovers_exact_weights_in_hf_layout(fixture, request, tmp_path):
    hf_dir = request.getfixturevalue(fixture)
    imported = read_weights(_round_trip(hf_dir, tmp_path))
    original = read_weights(hf_dir)
    assert imported.keys() == original.keys()
    for name, tensor in original.items():
        assert imported[name].dtype == tensor.dtype
        assert imported[name].equal(tensor), name


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_model_dir_untied"])
def test_import_recovers_config(fixture, request, tmp_path):
    hf_dir = request.getfixturevalue(fixture)
    imported = _round_trip(hf_dir, tmp_path)
    assert _read_json(imported / "config.json") == _read_json(hf_dir / "config.json")


def test_imported_weights_match_the_shapes_config_implies(tiny_model_dir_untied, tmp_path):
    imported = _round_trip(tiny_model_dir_untied, tmp_path)
    shapes = hf_tensor_shapes(_read_json(imported / "config.json"))
    assert {name: tuple(t.shape) for name, t in read_weights(imported).items()} == shapes


def test_imported_tokenizer_encodes_like_the_original(tiny_model_dir, tmp_path):
    imported = Tokenizer.from_file(str(_round_trip(tiny_model_dir, tmp_path) / "tokenizer.json"))
    original = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    texts = [*CORPUS, "<|im_start|>user\nhi 12345 🚀<|im_end|>\n", "unseen wörds ✓ 7"]
    for text in texts:
        assert imported.encode(text).ids == original.encode(text).ids, text
    assert imported.get_vocab_size() == original.get_vocab_size()


def test_control_tokens_become_special_added_tokens(tiny_model_dir, tmp_path):
    tokenizer_json = _read_json(_round_trip(tiny_model_dir, tmp_path) / "tokenizer.json")
    specials = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"] if t["special"]}
    assert specials == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


def test_import_writes_tokenizer_and_generation_config(tiny_model_dir, tmp_path):
    imported = _round_trip(tiny_model_dir, tmp_path)
    tokenizer_config = _read_json(imported / "tokenizer_config.json")
    original = _read_json(tiny_model_dir / "tokenizer_config.json")
    for key in ("chat_template", "bos_token", "eos_token", "add_bos_token"):
        assert tokenizer_config[key] == original[key], key
    assert _read_json(imported / "generation_config.json") == {
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    hf_dir = write_tiny_llama(tmp_path / "hf", rope_scaling=LLAMA3_SCALING)
    imported = _round_trip(hf_dir, tmp_path)
    assert _read_json(imported / "config.json")["rope_scaling"] == LLAMA3_SCALING
    assert "rope_freqs.weight" not in read_weights(imported)


@given(
    num_heads=st.integers(1, 6),
    half_head_dim=st.integers(1, 8),
    cols=st.integers(1, 5),
)
def test_unpermute_inverts_llama_cpp_permutation(num_heads, half_head_dim, cols):
    rows = num_heads * half_head_dim * 2
    weight = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    permuted = llama_cpp_permute(weight, num_heads)
    assert np.array_equal(unpermute_qk(permuted, num_heads), weight)


def test_non_llama_architecture_is_refused_by_name(tiny_model_dir, tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "gpt2.gguf", tiny_model_dir, architecture="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*only 'llama'"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_sentencepiece_tokenizer_is_refused(tiny_model_dir, tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "spm.gguf", tiny_model_dir, tokenizer_model="llama")
    with pytest.raises(UnsupportedModelError, match="tokenizer model 'llama'"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_unknown_pre_tokenizer_is_refused(tiny_model_dir, tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "pre.gguf", tiny_model_dir, pre_tokenizer="qwen2")
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'qwen2'"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_a_file_that_is_not_gguf_is_model_not_found(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match=r"bogus\.gguf"):
        convert_gguf(bogus, tmp_path / "out")
