"""GGUF tokenizers: each kind gives its own model's token ids, read back from a GGUF the tests write.

References, never our own code: for byte-level BPE, the `tokenizers` library running the
pipeline of the original model's tokenizer.json (written out below as JSON, transcribed from the
originals that llama.cpp's llama-vocab.cpp quotes beside its adaptations) over the same
vocabulary and merges; for SentencePiece, the `sentencepiece` library on a model trained here
with the family's settings. The vocabularies are trained here too, the byte-level ones with no
pre-tokenizer at all, so their merges cross every boundary a pre-tokenizer draws and a wrong
regex shows up as other ids.
"""

from __future__ import annotations

import io
import json
import re
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter, TokenType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_model import CORPUS, write_tiny_gguf, write_tiny_llama
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from nanoserve.errors import ModelNotFoundError, UnsupportedModelError
from nanoserve.llm import LLM
from nanoserve.loading.gguf import convert_gguf, open_gguf, read_metadata, write_tokenizer
from nanoserve.loading.gguf_tokenizer import tokenizer_from_gguf
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import IncrementalDetokenizer, Tokenizer

spm = pytest.importorskip("sentencepiece", reason="the SentencePiece reference needs the dev extra")

BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_USER_DEFINED = "<tool_call>"

# Mixed scripts, emoji (joined, skin tones, flags), digit runs, whitespace and newline runs,
# apostrophes in every case, special-token text, combining marks, full-width forms.
ADVERSARIAL = [
    "Hello world! I'm here, you're there; they'd've said we'll go.",
    "IT'S THE CAT'S. WE'RE HERE, YOU'VE GOT IT, I'LL GO, HE'D SAY, I'M OK",
    "It'S mIxEd: don'T, We'Re, you'vE, she'lL, I'd, 'tis, rock 'n' roll ''quoted''",
    "12345678901234567890 3.14159 1,000,000 0x1F 42nd 2024-06-01 ٣٤٥ ¹²³ ½",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\ttabs\n\nnewlines\n\n\n  \n indented\r\n windows\r\rold mac\n",
    "Emoji: 🚀🦙 😶‍🌫️ 👍🏽 🇫🇷 ❤️ 👨‍👩‍👧‍👦 and 🚀🚀🚀",
    "中文字符测试，日本語のテキスト、한국어 텍스트 and mixed中English文",
    "Ελληνικά ΣΊΣΥΦΟΣ, Русский ТЕКСТ, עברית, العربية, हिन्दी, ไทย, ქართული",
    "combining: e\u0301 a\u0308 n\u0303 (decomposed) é ä ñ (composed) Z\u0351\u036b\u0343\u036a",
    "Ｆｕｌｌ－ｗｉｄｔｈ　ｆｏｒｍｓ：ＡＢＣ１２３！？ and ｶﾀｶﾅ",
    "special <|im_start|>user\nhi<|im_end|> <|endoftext|><|endoftext|> <s> </s> <unk> <tool_call>{}",
    "code: def f(x):\n    return x**2  # comment\n\tif a != b: pass\n        \n",
    "MiXeD CaSe WoRdS, ALLCAPS, lowercase, CamelCaseWords, snake_case, kebab-case",
    "punctuation!!! ??? ... --- === ``` \"\"\" ''' /// \\\\ ((( ))) [[ ]] {{ }}",
    "URL https://example.com/a/b?c=d&e=f#g email a.b@c.de path C:\\Users\\x",
    "",
    " ",
    "\n",
    "a",
    "  \n\n  \t  x  ",
]
TRAINING_TEXT = [*CORPUS, *ADVERSARIAL]

# Pieces random texts are made of: the corpus's words and the adversarial corpus's hard parts.
FRAGMENTS = sorted({*" ".join(CORPUS).split(" "), " ", "  ", "\n", "\n\n", "\t", "\r\n", "'s", "'S", "'LL",
                    "'ve", "'D", "'", "0", "12", "345", "6789", "٣", "🚀", "🦙", "👍🏽", "\u200d", "e\u0301",
                    "\u0308", "Ｆｕｌｌ", "１２", "　", "中文", "ქართ", "ΣΊΣ", *BPE_SPECIALS, "<s>", "</s>",
                    BPE_USER_DEFINED, "<start_of_turn>", "...", "!!", "-", "_", "/", "\\"})
random_texts = st.lists(st.sampled_from(FRAGMENTS), max_size=24).map("".join)
any_text_settings = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture])


def _read_tokenizer(gguf_path: Path, tmp_path: Path) -> Tokenizer:
    """The GGUF's tokenizer as nanoserve runs it: through the files the importer writes."""
    meta = read_metadata(open_gguf(gguf_path))
    out = tmp_path / f"{gguf_path.stem}-tokenizer"
    out.mkdir()
    write_tokenizer(meta, tokenizer_from_gguf(meta), out)
    return Tokenizer.from_dir(out)


def _write_vocab_gguf(path: Path, keys: dict[str, Any]) -> Path:
    """A GGUF holding only tokenizer keys, written with the gguf package."""
    writer = GGUFWriter(str(path), "llama")
    _add_tokenizer_keys(writer, keys)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer_keys(writer: GGUFWriter, keys: dict[str, Any]) -> None:
    writer.add_tokenizer_model(keys["model"])
    if keys.get("pre") is not None:
        writer.add_tokenizer_pre(keys["pre"])
    writer.add_token_list(keys["tokens"])
    writer.add_token_types(keys["types"])
    if "merges" in keys:
        writer.add_token_merges(keys["merges"])
    if "scores" in keys:
        writer.add_token_scores(keys["scores"])
    for name in ("bos", "eos", "unk"):
        if f"{name}_id" in keys:
            getattr(writer, {"bos": "add_bos_token_id", "eos": "add_eos_token_id",
                             "unk": "add_unk_token_id"}[name])(keys[f"{name}_id"])
    if "add_space_prefix" in keys:
        writer.add_add_space_prefix(keys["add_space_prefix"])
    for key, value in keys.get("extra", {}).items():
        writer.add_bool(key, value)


# ---- byte-level BPE -----------------------------------------------------------------------------

def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_BYTE_LEVEL_NO_REGEX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                        "use_regex": False}
_BYTE_LEVEL_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
           r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
          r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_LLM = [
    r"[\r\n]",
    (r"\s?["
     "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-Ⴥ"
     "Ꭰ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbe"
     "ῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭ"
     "ℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏"
     "𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
     "]+"),
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
]
_LLAMA_CPP_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+",
                      r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                      r"\p{N}+", r"[0-9][0-9][0-9]"]


def _sequence(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": list(steps)}


# tokenizer.ggml.pre -> the original tokenizer.json's normalizer, pre_tokenizer and BPE flag.
ORIGINAL_PIPELINES: dict[str, dict[str, Any]] = {
    "gpt-2": {"pre_tokenizer": _BYTE_LEVEL_GPT2},  # openai-community/gpt2
    "smollm": {"pre_tokenizer": _sequence({"type": "Digits", "individual_digits": True},  # SmolLM2
                                          _BYTE_LEVEL_GPT2)},
    "llama-bpe": {"pre_tokenizer": _sequence(_split(_LLAMA3), _BYTE_LEVEL_NO_REGEX),  # Llama 3.x
                  "ignore_merges": True},
    "qwen2": {"normalizer": {"type": "NFC"},  # Qwen2.5, Qwen3
              "pre_tokenizer": _sequence(_split(_QWEN2), _BYTE_LEVEL_NO_REGEX)},
    "deepseek-r1-qwen": {"normalizer": {"type": "NFC"},
                         "pre_tokenizer": _sequence(_split(_QWEN2), _BYTE_LEVEL_NO_REGEX)},
    "tekken": {"pre_tokenizer": _sequence(_split(_TEKKEN), _BYTE_LEVEL_NO_REGEX),  # Mistral Nemo
               "ignore_merges": True},
    "gpt-4o": {"pre_tokenizer": _sequence(_split(_GPT4O), _BYTE_LEVEL_NO_REGEX)},  # Phi-4-mini
    "deepseek-llm": {"pre_tokenizer": _sequence(*map(_split, _DEEPSEEK_LLM), _BYTE_LEVEL_NO_REGEX)},
    # No tokenizer.json: what llama.cpp runs for a file that names 'default'.
    "default": {"pre_tokenizer": _sequence(*map(_split, _LLAMA_CPP_DEFAULT), _BYTE_LEVEL_NO_REGEX)},
}


@pytest.fixture(scope="module")
def byte_level_vocab() -> dict[str, Any]:
    """A byte-level vocabulary and merges trained with no regex, ChatML specials and one
    user-defined token after them."""
    trainer_backend = HFTokenizer(BPE())
    trainer_backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer_backend.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=1200, special_tokens=BPE_SPECIALS, max_token_length=6,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    trainer_backend.train_from_iterator(TRAINING_TEXT * 3, trainer=trainer)
    model = json.loads(trainer_backend.to_str())["model"]
    vocab = model["vocab"]
    tokens = [*sorted(vocab, key=vocab.get), BPE_USER_DEFINED]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TokenType.CONTROL if t in BPE_SPECIALS else TokenType.USER_DEFINED if t == BPE_USER_DEFINED
             else TokenType.NORMAL for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types}


def _reference_bpe(vocab: dict[str, Any], pre: str) -> HFTokenizer:
    pipeline = ORIGINAL_PIPELINES[pre]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": t in BPE_SPECIALS}
             for i, t in enumerate(vocab["tokens"]) if t in (*BPE_SPECIALS, BPE_USER_DEFINED)]
    model_vocab = {t: i for i, t in enumerate(vocab["tokens"])}
    return HFTokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": pipeline.get("normalizer"), "pre_tokenizer": pipeline["pre_tokenizer"],
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pipeline.get("ignore_merges", False), "vocab": model_vocab,
                  "merges": vocab["merges"]},
    }))


def _bpe_gguf(vocab: dict[str, Any], pre: str | None, tmp_path: Path, **keys: Any) -> Path:
    return _write_vocab_gguf(tmp_path / f"bpe-{pre}.gguf", {"model": "gpt2", "pre": pre, **vocab,
                                                             "bos_id": 1, "eos_id": 2, **keys})


@pytest.mark.parametrize("pre", sorted(ORIGINAL_PIPELINES))
def test_byte_level_ids_equal_the_original_pipeline_on_the_adversarial_corpus(pre, byte_level_vocab,
                                                                              tmp_path):
    ours = _read_tokenizer(_bpe_gguf(byte_level_vocab, pre, tmp_path), tmp_path)
    reference = _reference_bpe(byte_level_vocab, pre)
    for text in ADVERSARIAL:
        assert ours.encode(text, add_bos=False) == reference.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "tekken", "gpt-4o", "smollm"])
def test_byte_level_ids_equal_the_original_pipeline_on_random_texts(pre, byte_level_vocab, tmp_path):
    ours = _read_tokenizer(_bpe_gguf(byte_level_vocab, pre, tmp_path), tmp_path)
    reference = _reference_bpe(byte_level_vocab, pre)

    @any_text_settings
    @given(text=random_texts)
    def agrees(text):
        assert ours.encode(text, add_bos=False) == reference.encode(text, add_special_tokens=False).ids

    agrees()


@pytest.mark.parametrize("pre", sorted(ORIGINAL_PIPELINES))
def test_byte_level_decode_inverts_encode(pre, byte_level_vocab, tmp_path):
    ours = _read_tokenizer(_bpe_gguf(byte_level_vocab, pre, tmp_path), tmp_path)
    normalizes = "normalizer" in ORIGINAL_PIPELINES[pre]  # NFC: the promise is for NFC text
    for text in ADVERSARIAL:
        expected = unicodedata.normalize("NFC", text) if normalizes else text
        assert ours.decode(ours.encode(text, add_bos=False), skip_special_tokens=False) == expected


def test_the_corpus_tells_every_pre_tokenizer_apart(byte_level_vocab):
    """Otherwise agreement above would not show that each name got its own pipeline."""
    ids = {pre: [tuple(_reference_bpe(byte_level_vocab, pre).encode(t, add_special_tokens=False).ids)
                 for t in ADVERSARIAL] for pre in ORIGINAL_PIPELINES}
    distinct = {tuple(v) for k, v in ids.items() if k != "deepseek-r1-qwen"}
    assert len(distinct) == len(ORIGINAL_PIPELINES) - 1
    assert ids["deepseek-r1-qwen"] == ids["qwen2"]  # the same tokenizer under another name


def test_byte_level_specials_and_user_defined_tokens(byte_level_vocab, tmp_path):
    ours = _read_tokenizer(_bpe_gguf(byte_level_vocab, "qwen2", tmp_path), tmp_path)
    ids = ours.encode("<|im_start|>x<tool_call>")
    assert ids[0] == byte_level_vocab["tokens"].index("<|im_start|>")
    assert ids[-1] == byte_level_vocab["tokens"].index(BPE_USER_DEFINED)
    # Control tokens are special (dropped from text), user-defined ones are text.
    assert ours.decode(ids) == "x<tool_call>"


@pytest.mark.parametrize(("pre", "add_bos"), [("llama-bpe", True), ("tekken", True), ("qwen2", False),
                                              ("smollm", False)])
def test_bos_follows_llama_cpp_default_unless_the_file_says(pre, add_bos, byte_level_vocab, tmp_path):
    default = _read_tokenizer(_bpe_gguf(byte_level_vocab, pre, tmp_path), tmp_path)
    assert (default.encode("hi")[:1] == [1]) is add_bos
    (tmp_path / "said").mkdir()
    said = _read_tokenizer(_bpe_gguf(byte_level_vocab, pre, tmp_path / "said",
                                     extra={"tokenizer.ggml.add_bos_token": not add_bos,
                                            "tokenizer.ggml.add_eos_token": True}), tmp_path / "said")
    ids = said.encode("hi")
    assert (ids[0] == 1) is (not add_bos) and ids[-1] == 2
    assert said.encode("hi", add_bos=False) == default.encode("hi", add_bos=False)  # the text alone


@pytest.mark.parametrize(("eos_id", "ends"), [(2, {2}), (0, {0, 2})])
def test_end_of_turn_tokens_end_generation_as_in_llama_cpp(eos_id, ends, byte_level_vocab, tmp_path):
    """<|im_end|> ends a turn by its text; <|endoftext|> only when the file names it EOS."""
    ours = _read_tokenizer(_bpe_gguf(byte_level_vocab, "smollm", tmp_path, eos_id=eos_id), tmp_path)
    assert ours.eos_token_ids == ends


# ---- SentencePiece ------------------------------------------------------------------------------

# Each family's trainer and normalizer settings (from their tokenizer.model files): BPE pieces,
# byte fallback, digits split, identity normalization, whitespace kept; Llama 2, Mistral and
# Phi-3 put a dummy prefix in front, Gemma does not and has user-defined turn markers.
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "llama2": {"add_dummy_prefix": True, "unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1},
    "gemma": {"add_dummy_prefix": False, "pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3,
              "user_defined_symbols": ["<start_of_turn>", "<end_of_turn>"]},
}
SPM_SPECIAL_TEXT = "<s>hi</s> <unk> <start_of_turn>user\nhello<end_of_turn>\n"


@pytest.fixture(scope="module", params=sorted(FAMILY_SETTINGS))
def sentencepiece_model(request) -> tuple[str, Any]:
    settings = FAMILY_SETTINGS[request.param]
    proto = io.BytesIO()
    # Trained on the plain corpus only: the adversarial texts' emoji and rarer scripts fall back
    # to bytes.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=proto, model_type="bpe", vocab_size=700,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, hard_vocab_limit=False,
        character_coverage=1.0, minloglevel=2, **settings)
    return request.param, spm.SentencePieceProcessor(model_proto=proto.getvalue())


def _sentencepiece_keys(family: str, sp: Any) -> dict[str, Any]:
    """What llama.cpp's converter writes for a tokenizer.model."""
    user_defined = set(FAMILY_SETTINGS[family].get("user_defined_symbols", []))

    def kind(i: int) -> TokenType:
        if sp.is_unknown(i):
            return TokenType.UNKNOWN
        if sp.is_control(i):
            return TokenType.CONTROL
        if sp.is_byte(i):
            return TokenType.BYTE
        if sp.is_unused(i):
            return TokenType.UNUSED
        return TokenType.USER_DEFINED if sp.id_to_piece(i) in user_defined else TokenType.NORMAL

    size = sp.get_piece_size()
    return {"model": "llama", "pre": "default", "tokens": [sp.id_to_piece(i) for i in range(size)],
            "scores": [sp.get_score(i) for i in range(size)], "types": [kind(i) for i in range(size)],
            "bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "unk_id": sp.unk_id(),
            "add_space_prefix": FAMILY_SETTINGS[family]["add_dummy_prefix"]}


def _reference_sentencepiece(sp: Any, family: str, text: str) -> list[int]:
    """sentencepiece on the text between special tokens, each special its own id: Hugging Face's
    slow (sentencepiece) tokenizer and llama.cpp both split special-token text out first."""
    specials = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
                if sp.is_control(i) or sp.is_unknown(i)]
    specials += FAMILY_SETTINGS[family].get("user_defined_symbols", [])
    pattern = "(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")"
    ids: list[int] = []
    for part in re.split(pattern, text):
        if part in specials:
            ids.append(sp.piece_to_id(part))
        elif part:
            ids += sp.encode(part)
    return ids


def _spm_tokenizer(sentencepiece_model, tmp_path: Path) -> tuple[str, Any, Tokenizer]:
    family, sp = sentencepiece_model
    path = _write_vocab_gguf(tmp_path / f"spm-{family}.gguf", _sentencepiece_keys(family, sp))
    return family, sp, _read_tokenizer(path, tmp_path)


def test_sentencepiece_ids_equal_sentencepiece_on_the_adversarial_corpus(sentencepiece_model, tmp_path):
    family, sp, ours = _spm_tokenizer(sentencepiece_model, tmp_path)
    for text in [*ADVERSARIAL, *CORPUS, SPM_SPECIAL_TEXT]:
        assert ours.encode(text, add_bos=False) == _reference_sentencepiece(sp, family, text), text


def test_sentencepiece_ids_equal_sentencepiece_on_random_texts(sentencepiece_model, tmp_path):
    family, sp, ours = _spm_tokenizer(sentencepiece_model, tmp_path)

    @any_text_settings
    @given(text=random_texts)
    def agrees(text):
        assert ours.encode(text, add_bos=False) == _reference_sentencepiece(sp, family, text)

    agrees()


def test_sentencepiece_falls_back_to_bytes_and_decodes_like_sentencepiece(sentencepiece_model, tmp_path):
    _, sp, ours = _spm_tokenizer(sentencepiece_model, tmp_path)
    emoji = ours.encode("🦙")
    assert all(sp.is_byte(i) for i in emoji[-4:])  # the tiny vocabulary has no llama
    for text in ADVERSARIAL:
        if any(special in text for special in ("<s>", "</s>", "<unk>")):
            continue  # special-token text decodes to the specials, not back to itself
        ids = ours.encode(text, add_bos=False)
        assert ours.decode(ids) == sp.decode(ids) == text, text


def test_sentencepiece_bos_is_added_by_default(sentencepiece_model, tmp_path):
    _, sp, ours = _spm_tokenizer(sentencepiece_model, tmp_path)
    assert ours.encode("The capital")[0] == sp.bos_id()
    assert ours.eos_token_id == sp.eos_id()


def test_sentencepiece_pieces_around_an_image_are_each_what_sentencepiece_makes_of_them_alone(
        sentencepiece_model, tmp_path):
    """llama.cpp's mtmd tokenizes the text on each side of an image alone (a dummy prefix on
    each, where the model puts one), BOS before the first piece only: a LLaVA text GGUF's prompt."""
    _, sp, ours = _spm_tokenizer(sentencepiece_model, tmp_path)
    pieces = ["USER: ", "\nWhat is in the picture? ASSISTANT:", ""]
    assert ours.encode_pieces(pieces) == [[sp.bos_id(), *sp.encode(pieces[0])], sp.encode(pieces[1]), []]
    assert ours.encode_pieces(pieces[:1]) == [ours.encode(pieces[0])]


def test_gemma_stops_at_end_of_turn_though_the_file_names_only_eos(sentencepiece_model, tmp_path):
    family, sp, ours = _spm_tokenizer(sentencepiece_model, tmp_path)
    turn_end = {sp.piece_to_id("<end_of_turn>")} if family == "gemma" else set()
    assert ours.eos_token_ids == {sp.eos_id()} | turn_end


@pytest.mark.parametrize("text", ["🦙 llamas 🚀🚀 ok", "日本語のテキスト", "caf\u00e9 ✓ 👨‍👩‍👧‍👦"])
def test_streaming_detokenization_joins_byte_pieces_split_across_steps(text, sentencepiece_model, tmp_path):
    _, _, ours = _spm_tokenizer(sentencepiece_model, tmp_path)
    prompt = ours.encode("Once upon a time")
    ids = ours.encode(text, add_bos=False)
    detokenizer = IncrementalDetokenizer(ours, prompt_ids=prompt)
    deltas = [detokenizer.push([token]) for token in ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == ours.decode(prompt + ids)[len(ours.decode(prompt)):]
    assert not any("\ufffd" in delta for delta in deltas)


def test_byte_level_streaming_joins_characters_split_across_tokens(byte_level_vocab, tmp_path):
    ours = _read_tokenizer(_bpe_gguf(byte_level_vocab, "llama-bpe", tmp_path), tmp_path)
    text = "ｶﾀｶﾅ 👨‍👩‍👧‍👦 ქართული"
    ids = ours.encode(text, add_bos=False)
    detokenizer = IncrementalDetokenizer(ours)
    deltas = [detokenizer.push([token]) for token in ids] + [detokenizer.flush()]
    assert "".join(deltas) == text and not any("\ufffd" in delta for delta in deltas)


# ---- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("keys", "named"), [
    ({"model": "bert"}, r"'tokenizer\.ggml\.model' = 'bert'"),
    ({"model": "gpt2", "pre": "falcon"}, r"'tokenizer\.ggml\.pre' = 'falcon'"),
    ({"model": "gpt2", "pre": None}, r"'tokenizer\.ggml\.pre' = None"),
    ({"model": "gpt2", "pre": "qwen2", "merges": ["nospace"]}, r"'tokenizer\.ggml\.merges' holds 'nospace'"),
])
def test_an_unknown_tokenizer_is_refused_naming_the_key(keys, named, byte_level_vocab, tmp_path):
    path = _write_vocab_gguf(tmp_path / "refused.gguf", {**byte_level_vocab, **keys})
    with pytest.raises(UnsupportedModelError, match=named):
        tokenizer_from_gguf(read_metadata(open_gguf(path)))


@pytest.mark.parametrize(("keys", "named"), [
    ({"eos_id": 99999}, r"'tokenizer\.ggml\.eos_token_id' = 99999"),
    ({"bos_id": None}, r"'tokenizer\.ggml\.bos_token_id' is missing"),  # llama-bpe adds BOS
])
def test_a_special_token_id_outside_the_vocabulary_is_refused_naming_the_key(keys, named, byte_level_vocab,
                                                                              tmp_path):
    keys = {k: v for k, v in ({"bos_id": 1, "eos_id": 2} | keys).items() if v is not None}
    path = _write_vocab_gguf(tmp_path / "ids.gguf", {"model": "gpt2", "pre": "llama-bpe", **byte_level_vocab,
                                                      **keys})
    with pytest.raises(UnsupportedModelError, match=named):
        tokenizer_from_gguf(read_metadata(open_gguf(path)))


def test_collapsing_whitespace_is_refused_naming_the_key(sentencepiece_model, tmp_path):
    family, sp = sentencepiece_model
    keys = _sentencepiece_keys(family, sp) | {"extra": {"tokenizer.ggml.remove_extra_whitespaces": True}}
    path = _write_vocab_gguf(tmp_path / "ws.gguf", keys)
    with pytest.raises(UnsupportedModelError, match="remove_extra_whitespaces"):
        tokenizer_from_gguf(read_metadata(open_gguf(path)))


# ---- whole models: the engine runs on them, bad files exit 2 before any work ----------------------

@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _model_gguf(tmp_path: Path, keys: dict[str, Any], damage: str | None = None) -> Path:
    rows = len(keys["tokens"]) - (8 if damage == "vocab_larger_than_embedding" else 0)
    hf_dir = write_tiny_llama(tmp_path / "hf", vocab_size=rows)
    return write_tiny_gguf(tmp_path / "model.gguf", hf_dir,
                           tokenizer_keys=lambda writer: _add_tokenizer_keys(writer, keys),
                           tensor_hook=_DAMAGE.get(damage))


# A GGUF tensor's name and values -> what the damaged file holds instead.
_DAMAGE = {
    "wrong_shape": lambda name, values: values[:, :96] if name == "blk.0.ffn_down.weight" else values,
    "integer_tensor": lambda name, values: (values.astype(np.int32) if name == "blk.1.attn_norm.weight"
                                            else values),
}


def test_a_sentencepiece_model_generates_from_its_own_prompt_ids(sentencepiece_model, tmp_path,
                                                                 private_cache):
    family, sp = sentencepiece_model
    llm = LLM(str(_model_gguf(tmp_path, _sentencepiece_keys(family, sp))), kv_cache_gb=0.01, max_num_seqs=2)
    prompt = "The capital of France is 🦙"
    assert llm.tokenizer.encode(prompt) == [sp.bos_id(), *sp.encode(prompt)]
    completion = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(completion.token_ids) == 4


def _generate_cli(path: Path):
    from typer.testing import CliRunner

    from nanoserve_cli.main import app

    return CliRunner().invoke(app, ["generate", "hi", "--max-tokens", "2", "--model", str(path)])


def test_an_unknown_pre_tokenizer_exits_2_naming_the_key(byte_level_vocab, tmp_path, private_cache):
    path = _model_gguf(tmp_path, {"model": "gpt2", "pre": "falcon", **byte_level_vocab})
    result = _generate_cli(path)
    assert result.exit_code == 2, result.output
    assert "tokenizer.ggml.pre" in result.output and "Traceback" not in result.output


def _no_weight_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes reading any tensor's values raise: the checks must come first."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("a weight was read before the file was checked")
    monkeypatch.setattr("nanoserve.loading.gguf.dequantize", refuse)


@pytest.mark.parametrize(("damage", "named"), [
    ("vocab_larger_than_embedding", r"'token_embd\.weight' has \d+ rows but 'tokenizer\.ggml\.tokens' lists"),
    ("wrong_shape", r"'blk\.0\.ffn_down\.weight' has shape"),
    ("integer_tensor", r"'blk\.1\.attn_norm\.weight' is of type I32"),
])
def test_a_file_that_disagrees_with_its_metadata_is_refused_before_any_weight_is_read(
        damage, named, byte_level_vocab, tmp_path, private_cache, monkeypatch):
    keys = {"model": "gpt2", "pre": "qwen2", **byte_level_vocab}
    path = _model_gguf(tmp_path, keys, damage=damage)
    _no_weight_is_read(monkeypatch)
    with pytest.raises(UnsupportedModelError, match=named):
        convert_gguf(path, tmp_path / "out")
    result = _generate_cli(path)
    assert result.exit_code == 2 and re.search(named, result.output), result.output


def test_a_gguf_cut_inside_its_metadata_is_refused_naming_the_file(byte_level_vocab, tmp_path):
    path = _model_gguf(tmp_path, {"model": "gpt2", "pre": "qwen2", **byte_level_vocab})
    path.write_bytes(path.read_bytes()[:4096])
    with pytest.raises(ModelNotFoundError, match=r"model\.gguf"):
        convert_gguf(path, tmp_path / "out")


def test_the_checks_pass_a_sound_file(byte_level_vocab, tmp_path):
    keys = {"model": "gpt2", "pre": "qwen2", **byte_level_vocab}
    converted = convert_gguf(_model_gguf(tmp_path, keys), tmp_path / "out")
    reference = _reference_bpe(byte_level_vocab, "qwen2")
    assert Tokenizer.from_dir(converted).encode("hi 123") == reference.encode("hi 123").ids
