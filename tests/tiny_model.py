"""Tiny but real llama checkpoints for the fast tests: HF directories and GGUF files.

`write_tiny_llama` writes what the loader reads from disk: config.json, random float32
weights (one safetensors file or shards plus an index), a byte-level BPE tokenizer trained
here on a small built-in corpus, a ChatML template, and generation_config.json.
`write_tiny_gguf` turns such a directory into a llama.cpp style GGUF (Q/K rows permuted the
way its converter does), for testing the importer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE, Unigram
from tokenizers.trainers import BpeTrainer

from nanoserve.quant import FORMATS
from nanoserve.tokenizer import Tokenizer as NanoserveTokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN, EOS_TOKEN = "<|im_start|>", "<|im_end|>"
TOKENIZER_VOCAB_SIZE = 384
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Once upon a time, in a small village, there lived an old baker and his cat.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Water boils at 100 degrees Celsius and freezes at 0 degrees.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10. Counting is 42 times more fun in 2024.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import json\ndata = json.loads('{\"a\": [1, 2, 3]}')\n",
    "Ünïcödé: café, naïve, façade, jalapeño, Straße, Ærøskøbing.",
    "Emoji: 🚀 🎉 👍 ❤️ 🐍 and CJK: 你好，世界。日本語のテキスト。",
    "Greek αβγ δέλτα, Cyrillic привет мир, math ∑ ∫ √ ≤ ≥ ≠.",
    "The three primary colors are red, yellow and blue.",
    "Hello! How are you today? I am fine, thank you. What is your name?",
]


def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE (SmolLM's pre-tokenizer) with ChatML special tokens at ids 0..2."""
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer


SENTENCEPIECE_PIECES = ["<unk>", "<s>", "</s>", "\u2581The", "\u2581capital", "\u2581is", "\u2581Paris",
                        "\u2581caf", "é", "<0xC3>", "<0xA9>", "\u2581", "s"]


def sentencepiece_tokenizer(decoder: str) -> NanoserveTokenizer:
    """A SentencePiece-style vocabulary (Unigram, byte fallback) with the decoder of Mistral
    checkpoints (Metaspace) or of Llama 2's tokenizer.json (Replace, ByteFallback, Fuse, Strip)."""
    backend = Tokenizer(Unigram([(piece, -1.0) for piece in SENTENCEPIECE_PIECES],
                                           unk_id=0, byte_fallback=True))
    if decoder == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                             decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return NanoserveTokenizer(backend, bos_token="<s>", eos_token="</s>")



def write_tiny_llama(
    path: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = True,
    shards: int = 1,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """Write a complete HF llama directory with random weights; returns `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    config = _config(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=_model_vocab_size(tokenizer, vocab_size),
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        tokenizer=tokenizer,
    )
    _write_json(path / "config.json", config)
    _write_json(path / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
    )
    _write_weights(path, random_weights(config, seed), shards)
    return path


def _model_vocab_size(tokenizer: Tokenizer, requested: int | None) -> int:
    own = tokenizer.get_vocab_size(with_added_tokens=True)
    if requested is not None and requested < own:
        raise ValueError(f"vocab_size {requested} is smaller than the tokenizer's {own}")
    return own if requested is None else requested


def _config(*, tokenizer: Tokenizer, num_heads: int, hidden_size: int, **fields: Any) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": fields["vocab_size"],
        "hidden_size": hidden_size,
        "intermediate_size": fields["intermediate_size"],
        "num_hidden_layers": fields["num_layers"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": fields["num_kv_heads"],
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": fields["rope_scaling"],
        "tie_word_embeddings": fields["tie_word_embeddings"],
        "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
        "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        "torch_dtype": "float32",
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": "<|endoftext|>",
        "pad_token": EOS_TOKEN,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 512,
    }


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors: N(0, 0.02) matrices, all-ones norms."""
    generator = torch.Generator().manual_seed(seed)
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, hidden),
            p + "self_attn.k_proj.weight": (kv_rows, hidden),
            p + "self_attn.v_proj.weight": (kv_rows, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_rows),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return {name: _random_tensor(shape, generator) for name, shape in shapes.items()}


def _random_tensor(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.float32)
    return torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02


def _write_weights(path: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    if shards == 1:
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(weights)
    weight_map = {}
    for index, group in enumerate(np.array_split(np.arange(len(names)), shards), start=1):
        file_name = f"model-{index:05d}-of-{shards:05d}.safetensors"
        shard = {names[i]: weights[names[i]] for i in group}
        save_file(shard, path / file_name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file_name)
    total_size = sum(t.numel() * t.element_size() for t in weights.values())
    index_json = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    _write_json(path / "model.safetensors.index.json", index_json)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, sharded or not."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(path / "model.safetensors")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return {name: t for file in files for name, t in load_file(path / file).items()}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---- GGUF -----------------------------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (for its interleaved rotary layout)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_tensor_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, part = hf_name.removesuffix(".weight").split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[part]}.weight"


def write_tiny_gguf(
    path: str | Path,
    hf_dir: str | Path,
    *,
    architecture: str = "llama",
    tokenizer_model: str = "gpt2",
    pre_tokenizer: str = "smollm",
    matrix_type: GGMLQuantizationType | Callable[[str], GGMLQuantizationType] = GGMLQuantizationType.F32,
    tokenizer_keys: Callable[[GGUFWriter], None] | None = None,
    tensor_hook: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> Path:
    """Write the checkpoint in `hf_dir` as a GGUF the way llama.cpp would: float32, or with
    every matrix in `matrix_type` (norms stay float32), or in `matrix_type(tensor name)`, types
    mixed as llama-quantize's Q4_K_M mixes them. gguf quantizes Q8_0/Q4_0/Q4_1 itself;
    for other block types the matrices are random blocks (the values are not the checkpoint's).
    `tokenizer_keys` writes the tokenizer keys instead of the checkpoint's own tokenizer;
    `tensor_hook(name, values)` replaces a tensor's values as written (a damaged file)."""
    path, hf_dir = Path(path), Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    writer = GGUFWriter(str(path), architecture)
    _add_hparams(writer, config)
    if tokenizer_keys is None:
        _add_tokenizer(writer, hf_dir, config, tokenizer_model, pre_tokenizer)
    else:
        tokenizer_keys(writer)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for hf_name, tensor in read_weights(hf_dir).items():
        name = gguf_tensor_name(hf_name)
        values = tensor.numpy()
        kind = name.split(".")[-2]
        if kind in heads:
            values = llama_cpp_permute(values, heads[kind])
        if tensor_hook is not None:
            values = tensor_hook(name, values)
        tensor_type = matrix_type(name) if callable(matrix_type) else matrix_type
        if values.ndim == 2 and tensor_type != GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf_blocks(values, tensor_type), raw_dtype=tensor_type)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values))
    if config["rope_scaling"]:
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_blocks(values: np.ndarray, matrix_type: GGMLQuantizationType) -> np.ndarray:
    """A float32 matrix [rows, cols] in `matrix_type`: quantized by the `gguf` package where it
    can, else random blocks (the values are not the matrix's)."""
    try:
        return gguf_quantize(np.ascontiguousarray(values), matrix_type)
    except NotImplementedError:
        pass
    # Random codes, with f16 scales of a sane size wherever the format keeps them.
    block_values, block_bytes = GGML_QUANT_SIZES[matrix_type]
    rows, cols = values.shape
    rng = np.random.default_rng(rows * cols)
    blocks = rng.integers(0, 256, size=(rows * cols // block_values, block_bytes), dtype=np.uint8)
    known = FORMATS.get(matrix_type.name.lower())
    for offset in known.scale_offsets if known is not None else (0,):  # (0,): d first, as IQ3_S
        scales = rng.uniform(0.0005, 0.002, size=(len(blocks), 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _add_hparams(writer: GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(config["head_dim"])


def _add_tokenizer(writer: GGUFWriter, hf_dir: Path, config: dict[str, Any], model: str, pre: str) -> None:
    tokenizer_json = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tokenizer_json["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {added["content"] for added in tokenizer_json["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in specials else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(tokenizer_config["add_bos_token"])
    writer.add_chat_template(tokenizer_config["chat_template"])


def _llama3_rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """llama.cpp's per-frequency divisors for llama3 rope scaling."""
    scaling, head_dim = config["rope_scaling"], config["head_dim"]
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * config["rope_theta"] ** (i / head_dim)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)
