"""The tokenizer a GGUF file's `tokenizer.ggml.*` keys describe, as a `tokenizers.Tokenizer`.

Owns: turning the vocabulary, merges or scores, token types and pre-tokenizer name of a GGUF
into the pipeline of the model's own tokenizer, and what llama.cpp reads beside them (BOS and
EOS defaults per tokenizer kind, the tokens that end a turn). Two kinds, as llama.cpp names
them in `tokenizer.ggml.model`:
- `gpt2`, byte-level BPE: the vocabulary and merges as they are; the normalizer and
  pre-tokenizer of the original model's tokenizer.json, chosen by `tokenizer.ggml.pre`
  (`PRE_TOKENIZERS`: the regexes are the originals, which llama.cpp's llama-vocab.cpp keeps
  in comments beside its own adaptations; its `ignore_merges` and BOS defaults are kept too).
- `llama`, SentencePiece BPE (Llama 2, Mistral v0.1-v0.3, Gemma, Phi-3): the pieces merge by
  score, highest first, as llama.cpp and sentencepiece merge them; that order becomes the BPE
  merge list here (the rank of a merge is its piece's score), characters outside the vocabulary
  fall back to byte pieces, spaces become U+2581 and `tokenizer.ggml.add_space_prefix` says
  whether a text segment gets one in front (per segment between special tokens, as llama.cpp
  and Hugging Face's legacy Llama tokenizer do).
Control and unknown-type tokens become special added tokens (matched in text, dropped by
`skip_special_tokens`), user-defined ones plain added tokens.
Refuses, naming the key: any other tokenizer model, a `tokenizer.ggml.pre` without a recipe
here (or none at all), SentencePiece options whose effect is not reproduced
(`remove_extra_whitespaces`), a special-token id outside the vocabulary (or missing where the
file says to add it), and lists that do not line up (types or scores per token, merges of two
parts). Nothing is guessed: llama.cpp's fallback to its 'default' regexes for a missing name is
not taken; a file that says 'default' gets exactly those regexes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from nanoserve.errors import UnsupportedModelError

SENTENCEPIECE_SPACE = "\u2581"
MODEL_KEY = "tokenizer.ggml.model"
PRE_KEY = "tokenizer.ggml.pre"

# The original tokenizer.json regexes (llama.cpp's llama-vocab.cpp quotes each one above the
# adaptation its own regex engine needs).
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# deepseek-llm's tokenizer.json splits in six isolated steps; llama.cpp lists them in order. The
# letter class is Unicode's cased letters; six of them are escaped because Unicode normalization
# (NFC, which editors and text stores apply) replaces them with other letters.
DEEPSEEK_LLM_REGEXES = (
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
)
# What llama.cpp runs for a BPE file whose pre-tokenizer is 'default': its own four steps.
LLAMA_CPP_DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


@dataclass(frozen=True, slots=True)
class ByteLevelRecipe:
    """One original tokenizer.json's pipeline around a byte-level BPE model."""

    pre_tokenizer: Callable[[], pre_tokenizers.PreTokenizer]
    normalizer: Callable[[], normalizers.Normalizer] | None = None
    # A pre-token that is itself in the vocabulary is one token, merges or not (tiktoken's rule,
    # kept by Llama 3's and Tekken's tokenizer.json; llama.cpp sets the same flag for them).
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


def _isolated(*regexes: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    """Split on each regex in turn (matches and the text between them both kept), then map
    bytes to GPT-2's printable characters: the tokenizer.json shape of every regex recipe."""
    def build() -> pre_tokenizers.PreTokenizer:
        splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
        return pre_tokenizers.Sequence([*splits, _byte_level(use_regex=False)])
    return build


def _byte_level(*, use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # SmolLM's tokenizer.json: every digit its own pre-token, then GPT-2's regex.
    digits = pre_tokenizers.Digits(individual_digits=True)
    return pre_tokenizers.Sequence([digits, _byte_level(use_regex=True)])


# Keyed by the `tokenizer.ggml.pre` names llama.cpp's converter writes for these models.
PRE_TOKENIZERS: dict[str, ByteLevelRecipe] = {
    "gpt-2": ByteLevelRecipe(lambda: _byte_level(use_regex=True)),
    "smollm": ByteLevelRecipe(_smollm),  # SmolLM, SmolLM2
    "llama-bpe": ByteLevelRecipe(_isolated(LLAMA3_REGEX), ignore_merges=True, add_bos=True),  # Llama 3.x
    "qwen2": ByteLevelRecipe(_isolated(QWEN2_REGEX), normalizer=normalizers.NFC),  # Qwen1.5 to Qwen3
    "deepseek-r1-qwen": ByteLevelRecipe(_isolated(QWEN2_REGEX), normalizer=normalizers.NFC),
    "tekken": ByteLevelRecipe(_isolated(TEKKEN_REGEX), ignore_merges=True, add_bos=True),  # Mistral Nemo
    "gpt-4o": ByteLevelRecipe(_isolated(GPT4O_REGEX)),  # Phi-4-mini
    "deepseek-llm": ByteLevelRecipe(_isolated(*DEEPSEEK_LLM_REGEXES)),
    "default": ByteLevelRecipe(_isolated(*LLAMA_CPP_DEFAULT_REGEXES)),
}


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    """The backend plus what llama.cpp reads beside the vocabulary."""

    backend: Tokenizer
    add_bos: bool
    add_eos: bool


def tokenizer_from_gguf(meta: dict[str, Any]) -> GGUFTokenizer:
    """The tokenizer of a GGUF's metadata (its key/value section as plain values)."""
    model = meta.get(MODEL_KEY)
    if model == "gpt2":
        recipe = _recipe(meta.get(PRE_KEY))
        backend, add_bos = _byte_level_bpe(meta, recipe), recipe.add_bos
    elif model == "llama":
        backend, add_bos = _sentencepiece_bpe(meta), True
    else:
        raise UnsupportedModelError(
            f"GGUF key {MODEL_KEY!r} = {model!r}: tokenizer model not supported; supported: "
            "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
    tokenizer = GGUFTokenizer(
        backend,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    _check_special_ids(meta, tokenizer)
    return tokenizer


def _check_special_ids(meta: dict[str, Any], tokenizer: GGUFTokenizer) -> None:
    """BOS and EOS ids name tokens of the vocabulary, and one the file says to add is there."""
    for name, wanted in (("bos", tokenizer.add_bos), ("eos", tokenizer.add_eos)):
        key = f"tokenizer.ggml.{name}_token_id"
        if wanted and key not in meta:
            raise UnsupportedModelError(
                f"GGUF key {key!r} is missing, but the tokenizer adds a {name.upper()} token "
                f"(tokenizer.ggml.add_{name}_token or its default for this tokenizer)")
        _token_id(meta, key)


def _token_id(meta: dict[str, Any], key: str) -> int | None:
    """The id under `key`, refused when it is no token of the vocabulary."""
    token_id = meta.get(key)
    if token_id is not None and not 0 <= token_id < len(meta["tokenizer.ggml.tokens"]):
        raise UnsupportedModelError(
            f"GGUF key {key!r} = {token_id}: not an id of the {len(meta['tokenizer.ggml.tokens'])} tokens")
    return token_id


# End-of-turn tokens llama.cpp stops at by their text, because converters write no key for them
# (Gemma's <end_of_turn>, Phi-3's <|end|>); Hugging Face lists the same ones in these models'
# generation_config.json. llama.cpp's list also has <|endoftext|>, left out here: SmolLM and
# Qwen use it between documents, and their generation configs do not stop at it.
END_OF_TURN_TOKENS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|end|>",
                                "<end_of_turn>", "<EOT>", "_<EOT>", "<|return|>", "<|call|>",
                                "<end_of_utterance>"})
_END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def end_token_ids(meta: dict[str, Any]) -> list[int]:
    """Every id that ends generation: EOS, end-of-turn and end-of-message where the file names
    them, and the end-of-turn tokens llama.cpp finds by their text."""
    named = {_token_id(meta, key) for key in _END_KEYS} - {None}
    tokens = meta["tokenizer.ggml.tokens"]
    return sorted(named | {token_id for token_id, token in enumerate(tokens) if token in END_OF_TURN_TOKENS})


def _recipe(name: Any) -> ByteLevelRecipe:
    if name not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF key {PRE_KEY!r} = {name!r}: pre-tokenizer not supported; supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}")
    return PRE_TOKENIZERS[name]


def _vocabulary(meta: dict[str, Any]) -> tuple[list[str], list[int]]:
    tokens = list(_require(meta, "tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens)))
    if len(types) != len(tokens):
        raise UnsupportedModelError(
            f"GGUF key 'tokenizer.ggml.token_type' lists {len(types)} types for {len(tokens)} tokens")
    return tokens, types


def _byte_level_bpe(meta: dict[str, Any], recipe: ByteLevelRecipe) -> Tokenizer:
    tokens, types = _vocabulary(meta)
    merges = [_merge_pair(merge) for merge in _require(meta, "tokenizer.ggml.merges")]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=recipe.ignore_merges))
    if recipe.normalizer is not None:
        backend.normalizer = recipe.normalizer()
    backend.pre_tokenizer = recipe.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    _add_tokens(backend, tokens, types)
    return backend


def _merge_pair(merge: str) -> tuple[str, str]:
    # Split at the first space after the first character, as llama.cpp does: the left part is
    # never empty, so a merge of a space-like piece still reads one way.
    cut = merge.find(" ", 1)
    if cut < 0 or cut == len(merge) - 1:
        raise UnsupportedModelError(f"GGUF key 'tokenizer.ggml.merges' holds {merge!r}, not 'LEFT RIGHT'")
    return merge[:cut], merge[cut + 1:]


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    tokens, types = _vocabulary(meta)
    scores = list(_require(meta, "tokenizer.ggml.scores"))
    if len(scores) != len(tokens):
        raise UnsupportedModelError(
            f"GGUF key 'tokenizer.ggml.scores' lists {len(scores)} scores for {len(tokens)} tokens")
    if meta.get("tokenizer.ggml.remove_extra_whitespaces", False):
        raise UnsupportedModelError(
            "GGUF key 'tokenizer.ggml.remove_extra_whitespaces' = True: collapsing whitespace is not "
            "supported for SentencePiece vocabularies")
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    byte_fallback = TokenType.BYTE in types
    unk_id = _token_id(meta, "tokenizer.ggml.unknown_token_id")
    model = BPE(vocab={token: token_id for token_id, token in enumerate(tokens)},
                merges=score_merges(tokens, scores, types), byte_fallback=byte_fallback,
                unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=True)
    backend = Tokenizer(model)
    escape = normalizers.Replace(" ", SENTENCEPIECE_SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(SENTENCEPIECE_SPACE), escape])
                          if add_space_prefix else escape)
    steps = [decoders.Replace(SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    _add_tokens(backend, tokens, types)
    return backend




def score_merges(tokens: Sequence[str], scores: Sequence[float],
                 types: Sequence[int]) -> list[tuple[str, str]]:
    """Every (left, right) that concatenates to a piece, both parts pieces themselves, ranked
    by the merged piece's score, highest first: BPE over this list merges in SentencePiece's
    order. Equal scores keep vocabulary order."""
    # Only normal pieces: user-defined ones are matched whole before any merge (as sentencepiece
    # matches them), and byte, control, unknown and unused pieces never come out of one.
    mergeable = {token: token_id for token_id, (token, kind) in enumerate(zip(tokens, types, strict=True))
                 if kind == TokenType.NORMAL}
    ranked = []
    for piece, piece_id in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[piece_id], piece_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_tokens(backend: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens as specials, user-defined ones as plain added tokens; both are
    matched in raw text before the normalizer and the pre-tokenizer (as llama.cpp matches them)."""
    special = [AddedToken(token, special=True, normalized=False)
               for token, kind in zip(tokens, types, strict=True)
               if kind in (TokenType.CONTROL, TokenType.UNKNOWN)]
    plain = [AddedToken(token, special=False, normalized=False)
             for token, kind in zip(tokens, types, strict=True) if kind == TokenType.USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedModelError(f"GGUF metadata has no {key!r}, which its tokenizer needs")
    return meta[key]
