"""GGUF import: a tiny llama written the llama.cpp way comes back as the exact HF checkpoint."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import given
from hypothesis import strategies as st
from tiny_model import CORPUS, llama_cpp_permute, read_weights, write_tiny_gguf, write_tiny_llama
from tokenizers import Tokenizer

from nanoserve import native
from nanoserve.errors import ModelNotFoundError, UnsupportedModelError
from nanoserve.llm import LLM
from nanoserve.loading.gguf import convert_gguf, gguf_weights, open_gguf, read_tensors, unpermute_qk
from nanoserve.loading.hf_config import read_model_config
from nanoserve.loading.hf_names import hf_tensor_shapes
from nanoserve.model.linear import QUANTIZED_KERNELS
from nanoserve.quant import QuantizedWeight, dense
from nanoserve.sampling_params import SamplingParams

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
    shapes = hf_tensor_shapes(read_model_config(_read_json(imported / "config.json")))
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


def test_unknown_tokenizer_model_is_refused_naming_the_key(tiny_model_dir, tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "bert.gguf", tiny_model_dir, tokenizer_model="bert")
    with pytest.raises(UnsupportedModelError, match=r"'tokenizer\.ggml\.model' = 'bert'"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_unknown_pre_tokenizer_is_refused_naming_the_key(tiny_model_dir, tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "pre.gguf", tiny_model_dir, pre_tokenizer="falcon")
    with pytest.raises(UnsupportedModelError, match=r"'tokenizer\.ggml\.pre' = 'falcon'"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_a_file_that_is_not_gguf_is_model_not_found(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match=r"bogus\.gguf"):
        convert_gguf(bogus, tmp_path / "out")


# ---- GGUF files in their own quantization ------------------------------------------------------

QUANTIZED_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K",
                   "Q3_K", "F16", "BF16"]
needs_native = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """Rows of 256 and 512 values, so every block format (K formats: 256 per block) fits."""
    return write_tiny_llama(tmp_path_factory.mktemp("wide"), hidden_size=256, intermediate_size=512,
                            num_heads=4, num_kv_heads=2)


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _quantized_gguf(wide_model_dir: Path, tmp_path: Path, type_name: str) -> Path:
    return write_tiny_gguf(tmp_path / f"wide-{type_name}.gguf", wide_model_dir,
                           matrix_type=GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "F16"])
def test_the_tensor_table_reader_finds_what_ggufs_reader_finds(type_name, wide_model_dir, tmp_path):
    path = _quantized_gguf(wide_model_dir, tmp_path, type_name)
    theirs = GGUFReader(path).tensors
    ours = read_tensors(path)
    assert [t.name for t in ours] == [t.name for t in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.tensor_type == reference.tensor_type and mine.n_bytes == reference.n_bytes
        assert mine.shape.tolist() == reference.shape.tolist()
        their_bytes = np.ascontiguousarray(reference.data).view(np.uint8).reshape(-1)
        assert np.array_equal(mine.data.reshape(-1), their_bytes)


def _every_value_type_gguf(path: Path) -> Path:
    """A GGUF file with a key of every scalar type at its extreme, strings (non-ASCII, empty),
    arrays of every scalar type and of strings (gguf's writer refuses an empty array), and
    tensors of several types and ranks."""
    writer = GGUFWriter(str(path), "llama")
    for number, value_type in enumerate((GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16,
                                         GGUFValueType.INT16, GGUFValueType.UINT32, GGUFValueType.INT32,
                                         GGUFValueType.UINT64, GGUFValueType.INT64)):
        signed = value_type.name.startswith("INT")
        bits = int(value_type.name.removeprefix("U").removeprefix("INT"))
        extreme = -(2 ** (bits - 1)) if signed else 2**bits - 1
        writer.add_key_value(f"test.scalar.{number}", extreme, value_type)
        writer.add_key_value(f"test.array.{number}", [0, 1, extreme], GGUFValueType.ARRAY, value_type)
    writer.add_key_value("test.f32", 1e-5, GGUFValueType.FLOAT32)  # not exact in float32
    writer.add_key_value("test.f64", 0.1, GGUFValueType.FLOAT64)
    writer.add_key_value("test.true", True, GGUFValueType.BOOL)
    writer.add_key_value("test.false", False, GGUFValueType.BOOL)
    writer.add_key_value("test.string", "Grüße, 世界", GGUFValueType.STRING)
    writer.add_key_value("test.empty_string", "", GGUFValueType.STRING)
    writer.add_key_value("test.floats", [0.1, -2.5e-8, 3e38], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    writer.add_key_value("test.doubles", [0.1, -1e300], GGUFValueType.ARRAY, GGUFValueType.FLOAT64)
    writer.add_key_value("test.bools", [True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    writer.add_key_value("test.strings", ["a", "", "Ġthe", "é ü"], GGUFValueType.ARRAY, GGUFValueType.STRING)
    g = np.random.default_rng(0)
    writer.add_tensor("a.weight", g.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("b.weight", g.standard_normal((2, 4, 32), dtype=np.float32).astype(np.float16))
    writer.add_tensor("c.bias", g.standard_normal(7, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


def test_the_metadata_reader_gives_ggufs_values_for_every_type_and_its_whole_tensor_table(tmp_path):
    path = _every_value_type_gguf(tmp_path / "every.gguf")
    theirs = GGUFReader(path)
    ours = open_gguf(path)
    # gguf's reader adds the header as GGUF.* pseudo-keys; the file's own keys are the rest.
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata == expected
    assert {key: type(value) for key, value in ours.metadata.items()} == {
        key: type(value) for key, value in expected.items()}
    assert ours.metadata["test.f32"] == float(np.float32(1e-5)) and ours.metadata["test.array.7"][2] == -2**63
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.n_bytes) for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        their_bytes = np.ascontiguousarray(reference.data).view(np.uint8).reshape(-1)
        assert np.array_equal(mine.data.reshape(-1), their_bytes)


def test_the_metadata_reader_gives_ggufs_values_for_a_tokenizer_and_model_file(wide_model_dir, tmp_path):
    path = _quantized_gguf(wide_model_dir, tmp_path, "Q4_K")
    expected = {key: field.contents() for key, field in GGUFReader(path).fields.items()
                if not key.startswith("GGUF.")}
    assert open_gguf(path).metadata == expected
    assert len(expected["tokenizer.ggml.tokens"]) > 100


def test_the_tensor_table_reader_refuses_a_cut_file_and_a_stranger(wide_model_dir, tmp_path):
    path = _quantized_gguf(wide_model_dir, tmp_path, "Q8_0")
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelNotFoundError, match="truncated"):
        read_tensors(path)
    stranger = tmp_path / "stranger.gguf"
    stranger.write_bytes(b"GGUF but truncated")
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF"):
        read_tensors(stranger)


def _llm(path: Path, **options) -> LLM:
    return LLM(str(path), kv_cache_gb=0.01, max_num_seqs=4, max_num_batched_tokens=64, **options)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_blocks_read_from_the_file_are_the_float_conversion_exactly(type_name, wide_model_dir, tmp_path):
    path = _quantized_gguf(wide_model_dir, tmp_path, type_name)
    converted = convert_gguf(path, tmp_path / "f32")
    floats = read_weights(converted)
    blocks = gguf_weights(path, _read_json(converted / "config.json"))
    assert blocks.keys() == floats.keys()
    for name, weight in blocks.items():
        if weight.shape[-1] > 1 and len(weight.shape) == 2:
            assert isinstance(weight, QuantizedWeight) and weight.format.name == type_name.lower(), name
        # Q and K rows were permuted as whole rows of blocks, the same permutation as the floats.
        assert torch.equal(dense(weight), floats[name]), name


@needs_native
@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_each_block_format_loads_in_its_quantization_and_generates(type_name, wide_model_dir, tmp_path,
                                                                   private_cache):
    path = _quantized_gguf(wide_model_dir, tmp_path, type_name)
    quantized, reference = _llm(path), _llm(path, dtype="float32")
    assert quantized.engine.weight_format == type_name.lower()
    assert quantized.engine.kernel_choice.kernel.name in QUANTIZED_KERNELS
    # Held in the file's own bytes: nothing dequantized kept beside them.
    tensor_bytes = sum(t.n_bytes for t in GGUFReader(path).tensors)
    assert quantized.engine.weights_nbytes <= 1.15 * tensor_bytes
    prompts = ["The quick brown fox", "Once upon a time"]
    ours, exact = quantized.prompt_logits(prompts), reference.prompt_logits(prompts)
    # Activations rounded to 8 bits per block of 32 move the logits by a percent or so.
    assert float((ours - exact).abs().max()) <= 0.05 * float(exact.abs().max())
    completion = quantized.generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert len(completion.token_ids) == 6


@needs_native
@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_greedy_tokens_are_the_float32_twins_wherever_its_margin_exceeds_the_kernels_tolerance(
        type_name, wide_model_dir, tmp_path, private_cache):
    path = _quantized_gguf(wide_model_dir, tmp_path, type_name)
    quantized, twin = _llm(path), _llm(path, dtype="float32")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["Once upon a time", "The quick brown fox", "def fibonacci(n):", "Hello, world"]
    decided = 0
    pairs = zip(twin.generate(prompts, greedy), quantized.generate(prompts, greedy), strict=True)
    for expected, ours in pairs:
        for i, token in enumerate(expected.token_ids):
            prefix = expected.prompt_token_ids + expected.token_ids[:i]
            exact, approximate = twin.prompt_logits([prefix])[0], quantized.prompt_logits([prefix])[0]
            error = float((approximate - exact).abs().max())
            if i == 0:  # the logits test's bound; later positions carry the error of earlier ones
                assert error <= 0.05 * float(exact.abs().max())
            top = exact.topk(2).values
            if float(top[0] - top[1]) <= 2 * error:  # a call this close may go either way: stop
                break
            assert ours.token_ids[i] == token, f"{type_name}: {expected.prompt!r}, token {i}"
            decided += 1
    assert decided > 0, f"{type_name}: every prompt's first token is a close call; nothing tested"


@needs_native
@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "F16", "BF16"])
def test_each_new_type_gives_every_request_its_solo_tokens_and_logprobs_in_a_crowd(
        type_name, wide_model_dir, tmp_path, private_cache):
    from test_batch_invariance import crowd_prompts, fingerprint, params_for, staggered_crowd

    llm = _llm(_quantized_gguf(wide_model_dir, tmp_path, type_name))
    assert llm.engine.weight_format == type_name.lower()
    prompts, params = crowd_prompts(4), [params_for(i, max_tokens=6) for i in range(4)]
    alone = [fingerprint(llm.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(llm, prompts, params) == alone


@contextlib.contextmanager
def native_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """NANOSERVE_NO_NATIVE=1 for engines started inside (the library is loaded once per process)."""
    from nanoserve.native import quant as native_quant

    monkeypatch.setenv("NANOSERVE_NO_NATIVE", "1")
    native._load.cache_clear()
    native_quant._lib.cache_clear()
    try:
        yield
    finally:
        monkeypatch.delenv("NANOSERVE_NO_NATIVE")
        native._load.cache_clear()
        native_quant._lib.cache_clear()


def test_without_native_kernels_a_gguf_is_dequantized_at_load_and_says_so(wide_model_dir, tmp_path,
                                                                           private_cache, monkeypatch):
    path = _quantized_gguf(wide_model_dir, tmp_path, "Q4_1")
    with native_off(monkeypatch):
        plain = _llm(path)
        exact = _llm(path, dtype="float32")
    assert any("dequantized to float32 at load" in note for note in plain.engine.weight_notes)
    assert plain.engine.weight_format == "float32"
    prompts = ["The quick brown fox"]
    assert torch.equal(plain.prompt_logits(prompts), exact.prompt_logits(prompts))


@needs_native  # without the library every type is dequantized, and the note says that instead
def test_a_type_without_a_kernel_is_dequantized_at_load_naming_the_type(wide_model_dir, tmp_path,
                                                                         private_cache):
    path = _quantized_gguf(wide_model_dir, tmp_path, "IQ3_S")
    llm = _llm(path)
    assert any("IQ3_S has no native kernel" in note and "blk.0." in note for note in llm.engine.weight_notes)
    completion = llm.generate(["Once upon"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(completion.token_ids) == 4


@needs_native
@pytest.mark.parametrize("format_name", ["q8_0", "q4_0"])
def test_quantize_runs_a_float_checkpoint_on_the_quantized_weights(format_name, wide_model_dir,
                                                                   private_cache, monkeypatch):
    quantized = _llm(wide_model_dir, quantize=format_name)
    with native_off(monkeypatch):  # the same quantized weights, dequantized at load
        dequantized = _llm(wide_model_dir, quantize=format_name)
    assert quantized.engine.weight_format == format_name
    assert any("dequantized to float32 at load" in note for note in dequantized.engine.weight_notes)
    prompts = ["The quick brown fox"]
    ours, exact = quantized.prompt_logits(prompts), dequantized.prompt_logits(prompts)
    float_model = _llm(wide_model_dir).prompt_logits(prompts)
    assert not torch.equal(exact, float_model)  # the weights were quantized
    # What is left between the two is the kernels' rounding of activations to 8 bits.
    assert float((ours - exact).abs().max()) <= 0.05 * float(exact.abs().max())


def _generate_cli(*args: str):
    from typer.testing import CliRunner

    from nanoserve_cli.main import app

    return CliRunner().invoke(app, ["generate", "hi", "--max-tokens", "2", *args])


def test_a_truncated_gguf_exits_2_naming_the_file(wide_model_dir, tmp_path, private_cache):
    path = _quantized_gguf(wide_model_dir, tmp_path, "Q8_0")
    path.write_bytes(path.read_bytes()[:-1000])
    result = _generate_cli("--model", str(path))
    assert result.exit_code == 2, result.output
    assert path.name in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("why", ["unknown format", "already quantized"])
def test_quantize_exits_2_naming_the_option(why, wide_model_dir, tmp_path, private_cache):
    if why == "unknown format":
        result = _generate_cli("--model", str(wide_model_dir), "--quantize", "q3_x")
    else:
        result = _generate_cli("--model", str(_quantized_gguf(wide_model_dir, tmp_path, "Q8_0")),
                               "--quantize", "q8_0")
    assert result.exit_code == 2, result.output
    assert "--quantize" in result.output and "Traceback" not in result.output
