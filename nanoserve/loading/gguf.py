"""Import a llama-architecture GGUF file as a Hugging Face style checkpoint directory.

Owns: turning GGUF metadata into config.json, dequantizing every tensor to float32, undoing
llama.cpp's Q/K row permutation, renaming tensors to HF names, and writing the tokenizer that
`gguf_tokenizer` builds (tokenizer.json, tokenizer_config.json, generation_config.json). And the other
way in: `gguf_weights` reads the tensors as they are (blocks stay blocks and F16 / BF16 matrices
stay 16-bit, one copy out of the file's memory map, Q/K rows permuted as whole rows of blocks)
for runs in the file's own quantization; `import_metadata` then writes only the config and tokenizer files.
Architectures: llama, qwen2, qwen3, phi3, gemma2, gemma3, qwen2vl (Qwen2 with M-RoPE's
`rope.dimension_sections`; Qwen2-VL's and Qwen2.5-VL's text model) (their `{arch}.*` metadata; only
llama's Q/K rows are permuted by llama.cpp's converter, the others keep HF's rotate_half
layout). What llama.cpp keeps in code rather than in the file is restated here: Gemma's norms
are stored as 1 + w (taken back to w, the HF form), Gemma 2's query scale is 1/sqrt(head_dim)
except for the 46-layer 27B (1/sqrt(hidden / heads)), Gemma's sliding layers are every other
(Gemma 2) or five of six (Gemma 3) unless the file says its pattern, Gemma 3's sliding layers
rotate with base 10000 unless it says `rope.freq_base_swa`, and a phi3 `rope.dimension_count`
below the head size is Phi-4-mini's partial_rotary_factor.
Mixtures of experts: qwen2moe, qwen3moe, olmoe, and llama with `expert_count` (Mixtral, whose
Q/K rows llama.cpp permutes as llama's); the router `ffn_gate_inp`, the stacked experts
`ffn_{gate,up,down}_exps` [experts, rows, cols] split into HF's per-expert tensors (each one
whole rows of blocks), Qwen2-MoE's `ffn_*_shexp` and `ffn_gate_inp_shexp`. llama.cpp keeps the
top-k renormalisation in code (Qwen3-MoE and Mixtral renormalise, Qwen2-MoE and OLMoE do not)
unless the file says `expert_weights_norm`; a layer without `ffn_gate_inp` is dense.
Refuses: other architectures, tokenizers `gguf_tokenizer` refuses, rope scaling other than
llama3, and a file whose tensors disagree with its metadata (a tensor of another shape or of an
integer type, an embedding with another row count than the vocabulary, a missing tensor): each
named, from the tensor list, before any weight is read.
It writes into the directory it is given; caching and atomic placement belong to
`default_model`.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import save_file

from nanoserve.errors import ModelNotFoundError, UnsupportedModelError
from nanoserve.loading.gguf_tokenizer import GGUFTokenizer, end_token_ids, tokenizer_from_gguf
from nanoserve.loading.hf_config import read_model_config
from nanoserve.loading.hf_names import expert_name, hf_tensor_shapes
from nanoserve.quant import FORMATS_BY_GGML_TYPE, QuantizedWeight

SUPPORTED_ARCHITECTURE = "llama"
# GGUF architecture -> (HF model_type, HF architecture).
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM"), "phi3": ("phi3", "Phi3ForCausalLM"),
                 # Qwen2-VL's and Qwen2.5-VL's text model: Qwen2 with M-RoPE (its image side: an mmproj)
                 "qwen2vl": ("qwen2", "Qwen2ForCausalLM"),
                 "gemma2": ("gemma2", "Gemma2ForCausalLM"), "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
                 "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
                 "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
                 "olmoe": ("olmoe", "OlmoeForCausalLM")}
MIXTRAL = ("mixtral", "MixtralForCausalLM")  # a llama GGUF with experts
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# Phi-3's LongRoPE factors, folded into config.json's rope_scaling.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
WEIGHTS_FILE = "model.safetensors"
ROPE_FREQS_TENSOR = "rope_freqs.weight"

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The stacked experts [experts, rows, cols] -> each expert's HF projection.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Where an architecture names a layer tensor otherwise than llama does.
_LAYER_TENSORS_BY_TYPE = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_LAYER_TENSORS_BY_TYPE["gemma3_text"] = _LAYER_TENSORS_BY_TYPE["gemma2"]
_LAYER_TENSORS_BY_TYPE["mixtral"] = {"ffn_gate_inp": "block_sparse_moe.gate"}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)")

# Llama 3.x checkpoints all use these; the stored factors are checked against them, so a
# model with other values is refused rather than run with the wrong frequencies.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192


def convert_gguf(gguf_path: str | Path, out_dir: str | Path,
                 progress: Callable[[int, int], None] | None = None) -> Path:
    """Write config, float32 weights and tokenizer files for `gguf_path` into `out_dir`.

    `progress(done, total)` is called after each tensor is dequantized (the slow part)."""
    file = open_gguf(gguf_path)
    config = import_metadata(file, out_dir)
    tensors = {tensor.name: tensor for tensor in file.tensors}
    weights = hf_weights(tensors, config, progress)
    save_file(weights, Path(out_dir) / WEIGHTS_FILE, metadata={"format": "pt"})
    return Path(out_dir)


def import_metadata(source: str | Path | GGUFFile, out_dir: str | Path) -> dict[str, Any]:
    """Write config.json and the tokenizer files for a GGUF into `out_dir` (no weights);
    returns the config."""
    file = source if isinstance(source, GGUFFile) else open_gguf(source)
    meta = read_metadata(file)
    check_architecture(meta)
    tokenizer = tokenizer_from_gguf(meta)
    config = llama_config(meta, {tensor.name: tensor for tensor in file.tensors})
    check_tensors(file, config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(meta, tokenizer, out)
    write_json(out / "config.json", config)
    return config


def write_tokenizer(meta: dict[str, Any], tokenizer: GGUFTokenizer, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json, as `Tokenizer.from_dir`
    reads them."""
    tokenizer.backend.save(str(out_dir / "tokenizer.json"))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, tokenizer))
    write_json(out_dir / "generation_config.json", generation_config(meta))


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a GGUF file as `read_gguf` finds it: what nanoserve reads of gguf's
    TensorEntry (its dims fastest-varying first; its bytes a read-only view of the map)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray  # uint8 [rows, bytes a row]
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """A GGUF file's key/value metadata as plain Python values (what gguf's
    `ReaderField.contents()` gives: ints, floats, bools, strings, lists of them) and its tensors."""

    metadata: dict[str, Any]
    tensors: list[TensorEntry]


# GGUF's key/value types (gguf.GGUFValueType) -> the struct format of one scalar value (8: a
# string, 9: an array; neither has a fixed size). The spec: llama.cpp's docs/gguf.md.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_BYTES = {kind: struct.calcsize(f"<{fmt}") for kind, fmt in _SCALAR_FORMATS.items()}
_STRING, _ARRAY = 8, 9


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensors. Our own reader rather than gguf's `GGUFReader`, which
    builds numpy objects for every element of every array (a 49152-word vocabulary and its
    merges: seconds at a model's first start); the same values (tests hold the two equal).
    Raises ModelNotFoundError for a file that is not a readable GGUF or is cut short."""
    return _read(path, with_values=True)


def read_tensors(path: str | Path) -> list[TensorEntry]:
    """The file's tensors, reading the key/value section only to step over it."""
    return _read(path, with_values=False).tensors


def _read(path: str | Path, *, with_values: bool) -> GGUFFile:
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        return _parse(path, mapped, memoryview(mapped), with_values)
    except (OSError, ValueError, IndexError, KeyError, struct.error, UnicodeDecodeError) as err:
        raise ModelNotFoundError(f"{path}: not a readable GGUF file ({err})") from err


def _string(view: memoryview, at: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", view, at)
    return bytes(view[at + 8 : at + 8 + length]).decode("utf-8"), at + 8 + length


def _skip(view: memoryview, kind: int, at: int) -> int:
    """Where the value of type `kind` at `at` ends."""
    if kind == _STRING:
        return at + 8 + struct.unpack_from("<Q", view, at)[0]
    if kind != _ARRAY:
        return at + _SCALAR_BYTES[kind]
    item, count = struct.unpack_from("<IQ", view, at)
    at += 12
    if item in _SCALAR_BYTES:
        return at + count * _SCALAR_BYTES[item]
    for _ in range(count):
        at = _skip(view, item, at)
    return at


def _value(view: memoryview, kind: int, at: int) -> tuple[Any, int]:
    """The value of type `kind` at `at`, and where it ends."""
    if kind == _STRING:
        return _string(view, at)
    if kind != _ARRAY:
        return struct.unpack_from(f"<{_SCALAR_FORMATS[kind]}", view, at)[0], at + _SCALAR_BYTES[kind]
    item, count = struct.unpack_from("<IQ", view, at)
    at += 12
    if item in _SCALAR_FORMATS:  # one unpack for the whole array
        values = struct.unpack_from(f"<{count}{_SCALAR_FORMATS[item]}", view, at)
        return list(values), at + count * _SCALAR_BYTES[item]
    values = []
    for _ in range(count):
        value, at = _value(view, item, at)
        values.append(value)
    return values, at


def _parse(path: str | Path, mapped: np.ndarray, view: memoryview, with_values: bool) -> GGUFFile:
    magic, version, tensor_count, kv_count = struct.unpack_from("<4sIQQ", view, 0)
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"magic {magic!r}, version {version}")
    at, alignment = 24, 32
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, at = _string(view, at)
        (kind,) = struct.unpack_from("<I", view, at)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", view, at + 4)
        if with_values:
            metadata[key], at = _value(view, kind, at + 4)
        else:
            at = _skip(view, kind, at + 4)
    infos = []
    for _ in range(tensor_count):
        name, at = _string(view, at)
        (dims,) = struct.unpack_from("<I", view, at)
        shape = np.array(struct.unpack_from(f"<{dims}Q", view, at + 4), dtype=np.uint64)
        kind, offset = struct.unpack_from("<IQ", view, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        infos.append((name, GGMLQuantizationType(kind), shape, offset))
    start = -(-at // alignment) * alignment
    entries = []
    for name, kind, shape, offset in infos:
        block_values, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = int(shape[0]) // block_values * block_bytes
        n_bytes = row_bytes * math.prod(int(d) for d in shape[1:])
        data = mapped[start + offset : start + offset + n_bytes]
        if data.nbytes != n_bytes:
            raise ModelNotFoundError(f"{path}: truncated or corrupt GGUF file (tensor {name!r} holds "
                                     f"{data.nbytes} of its {n_bytes} bytes)")
        entries.append(TensorEntry(name, kind, shape, data.reshape(-1, row_bytes), n_bytes))
    return GGUFFile(metadata, entries)


def read_metadata(file: GGUFFile) -> dict[str, Any]:
    """The key/value section as plain Python values (strings, numbers, lists)."""
    return file.metadata


def check_architecture(meta: dict[str, Any]) -> None:
    architecture = meta.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {architecture!r} is not supported: "
            f"only {' / '.join(repr(a) for a in ARCHITECTURES)} models can be imported"
        )


# Integer tensors are no weights; a file that has one is not what its metadata says.
_NOT_WEIGHT_TYPES = ("I8", "I16", "I32", "I64")


def check_tensors(file: GGUFFile, config: dict[str, Any]) -> None:
    """Each tensor's name, type and shape against what the metadata implies, from the file's
    tensor list alone: a file that disagrees is refused naming the tensor (or the key it
    disagrees with) before any weight is read."""
    expected = hf_tensor_shapes(read_model_config(config))
    present = set()
    for tensor in file.tensors:
        if tensor.name == ROPE_FREQS_TENSOR or tensor.name in LONGROPE_TENSORS:
            continue
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        _check_type(tensor)
        if tensor.name == "token_embd.weight" and shape[0] != config["vocab_size"]:
            raise UnsupportedModelError(
                f"GGUF tensor 'token_embd.weight' has {shape[0]} rows but 'tokenizer.ggml.tokens' "
                f"lists {config['vocab_size']} tokens")
        for name, part in _hf_shapes(tensor.name, shape, config).items():
            if name in expected and part != expected[name]:
                raise UnsupportedModelError(
                    f"GGUF tensor {tensor.name!r} has shape {shape}; the metadata implies {expected[name]}")
            present.add(name)
    missing = sorted(expected.keys() - present)
    if missing:
        raise UnsupportedModelError(f"GGUF lacks tensors a {config['model_type']} model needs: {missing[:5]}")


def _hf_shapes(gguf_name: str, shape: tuple[int, ...], config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The HF tensors a GGUF tensor of `shape` becomes, each with its shape (a stacked experts
    tensor [experts, rows, cols]: each expert's [rows, cols], the count checked)."""
    if gguf_name.split(".")[-2] not in _EXPERT_TENSORS:
        return {hf_tensor_name(gguf_name, config.get("model_type")): shape}
    names = expert_names(gguf_name, config)
    if len(shape) != 3 or shape[0] != len(names):
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has shape {shape}; the metadata implies "
                                    f"{len(names)} stacked experts")
    return dict.fromkeys(names, shape[1:])


def _check_type(tensor: TensorEntry) -> None:
    type_name = tensor.tensor_type.name
    if type_name in _NOT_WEIGHT_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name!r} is of type {type_name}, which holds no weights")


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---- config -------------------------------------------------------------------------------


def llama_config(meta: dict[str, Any], tensors: dict[str, TensorEntry]) -> dict[str, Any]:
    """config.json for the HF layout of the file's architecture, from its `{arch}.*` metadata
    and the tensor list."""
    arch = meta.get("general.architecture", "llama")
    model_type, hf_architecture = ARCHITECTURES[arch]
    meta = {key.replace(f"{arch}.", "llama.", 1) if key.startswith(f"{arch}.") else key: value
            for key, value in meta.items()}
    if arch == "llama" and meta.get("llama.expert_count"):
        model_type, hf_architecture = MIXTRAL
    config = _llama_layout_config(arch, model_type, hf_architecture, meta, tensors)
    config |= _experts_config(model_type, meta, tensors)
    return _gemma3_rope(config, meta) if arch == "gemma3" else config


def _llama_layout_config(arch: str, model_type: str, hf_architecture: str, meta: dict[str, Any],
                         tensors: dict[str, TensorEntry]) -> dict[str, Any]:
    hidden_size = _require_int(meta, "llama.embedding_length")
    num_heads = _require_int(meta, "llama.attention.head_count")
    head_dim = int(meta.get("llama.attention.key_length", hidden_size // num_heads))
    rope_theta = f32_to_float(meta.get("llama.rope.freq_base", 10000.0))
    partial = _partial_rotary(arch, meta, head_dim)
    return partial | {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden_size,
        "intermediate_size": _require_int(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _require_int(meta, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": _require_int(meta, "llama.context_length"),
        "rms_norm_eps": f32_to_float(_require(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling(meta, tensors, head_dim, rope_theta),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    } | _family_config(arch, meta, tensors, head_dim)


def _family_config(arch: str, meta: dict[str, Any], tensors: dict[str, TensorEntry],
                   head_dim: int) -> dict[str, Any]:
    """The config.json fields of the families beyond llama (meta's keys read as `llama.*`)."""
    layers = meta["llama.block_count"]
    window = meta.get("llama.attention.sliding_window")
    if arch == "phi3":
        config: dict[str, Any] = {"sliding_window": window}
        if LONGROPE_TENSORS[0] in tensors:
            original = _require_int(meta, "llama.rope.scaling.original_context_length")
            config["original_max_position_embeddings"] = original
            config["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": dequantize_tensor(tensors[LONGROPE_TENSORS[0]]).tolist(),
                "short_factor": dequantize_tensor(tensors[LONGROPE_TENSORS[1]]).tolist(),
                "original_max_position_embeddings": original}
            if "llama.rope.scaling.attn_factor" in meta:
                factor = meta["llama.rope.scaling.attn_factor"]
                config["rope_scaling"]["attention_factor"] = f32_to_float(factor)
        return config
    if arch == "qwen2vl":
        return {"mrope_section": _mrope_section(meta)}
    if arch not in ("gemma2", "gemma3"):
        return {}
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    pattern = meta.get("llama.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    # An integer n: every n-th layer is global; a list: each layer's "is sliding".
    if isinstance(pattern, list):
        sliding = [bool(s) for s in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    if len(sliding) != layers:
        raise UnsupportedModelError(f"GGUF sliding_window_pattern {pattern!r} does not cover {layers} layers")
    config = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if arch == "gemma2" and layers == 46 else head_dim,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }
    if arch == "gemma2":
        config["attn_logit_softcapping"] = f32_to_float(meta.get("llama.attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = f32_to_float(meta.get("llama.final_logit_softcapping", 30.0))
    return config


def _mrope_section(meta: dict[str, Any]) -> list[int]:
    """M-RoPE's (temporal, height, width) split of the rotated pairs: llama.cpp's converter pads
    the three to four with a 0 (`rope.dimension_sections`); a fourth section is refused."""
    sections = meta.get("llama.rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) not in (3, 4) or any(sections[3:]):
        raise UnsupportedModelError(f"GGUF metadata qwen2vl.rope.dimension_sections = {sections!r}: M-RoPE "
                                    "over three axes (a fourth section of 0)")
    return [int(n) for n in sections[:3]]


# llama.cpp's expert_gating_func values, and the models it renormalises the top-k weights of
# in code when the file does not say `expert_weights_norm`.
_GATING_SOFTMAX = 1
_RENORMALISED_IN_CODE = ("qwen3_moe", "mixtral")
_GROUPED_EXPERT_KEYS = ("llama.expert_group_count", "llama.expert_group_used_count",
                        "llama.expert_shared_count")


def _experts_config(model_type: str, meta: dict[str, Any],
                    tensors: dict[str, TensorEntry]) -> dict[str, Any]:
    """config.json's expert fields from `{arch}.expert_*` (meta's keys read as `llama.*`)."""
    count = meta.get("llama.expert_count", 0)
    if not count:
        return {}
    gating = meta.get("llama.expert_gating_func", _GATING_SOFTMAX)
    if gating != _GATING_SOFTMAX:
        raise UnsupportedModelError(f"GGUF metadata expert_gating_func = {gating!r}: only softmax routing "
                                    f"({_GATING_SOFTMAX}) is implemented")
    scale = f32_to_float(meta.get("llama.expert_weights_scale", 1.0))
    if scale != 1.0:
        raise UnsupportedModelError(f"GGUF metadata expert_weights_scale = {scale!r}: scaled expert weights "
                                    "are not implemented")
    for key in _GROUPED_EXPERT_KEYS:
        if key == "llama.expert_shared_count" and model_type == "qwen2_moe":
            continue  # Qwen2-MoE's one shared expert
        if meta.get(key, 0) not in (0, 1):
            raise UnsupportedModelError(f"GGUF metadata {key.split('.', 1)[1]} = {meta[key]!r}: grouped or "
                                        "several shared experts are not implemented")
    layers = meta["llama.block_count"]
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    norm = meta.get("llama.expert_weights_norm", model_type in _RENORMALISED_IN_CODE)
    config = {"num_local_experts" if model_type == "mixtral" else "num_experts": count,
              "num_experts_per_tok": _require_int(meta, "llama.expert_used_count")}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        config |= {"moe_intermediate_size": _require_int(meta, "llama.expert_feed_forward_length"),
                   "norm_topk_prob": bool(norm), "mlp_only_layers": dense}
    elif dense:
        raise UnsupportedModelError(f"GGUF layers {dense} have no experts (no ffn_gate_inp); a {model_type} "
                                    "model is sparse in every layer")
    elif model_type == "olmoe":
        config["norm_topk_prob"] = bool(norm)
    elif not norm:
        raise UnsupportedModelError("GGUF metadata expert_weights_norm = false: Mixtral always renormalises")
    if model_type == "qwen2_moe":
        shared = _require_int(meta, "llama.expert_shared_feed_forward_length")
        config["shared_expert_intermediate_size"] = shared
    return config


def _gemma3_rope(config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's per-layer-type RoPE: the file's scaling applies to its global layers only."""
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    full |= config.pop("rope_scaling") or {}
    local_theta = meta.get("llama.rope.freq_base_swa", 10000.0)
    local = {"rope_type": "default", "rope_theta": f32_to_float(local_theta)}
    return {**config, "rope_parameters": {"full_attention": full, "sliding_attention": local}}


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedModelError(f"GGUF metadata has no {key!r}, which a llama model needs")
    return meta[key]


def _require_int(meta: dict[str, Any], key: str) -> int:
    value = _require(meta, key)
    if not isinstance(value, int):
        raise UnsupportedModelError(f"GGUF metadata {key!r} is {value!r}; expected one integer")
    return value


def f32_to_float(value: float) -> float:
    """A GGUF float32 as the decimal the original config wrote: the shortest that round-trips
    (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _partial_rotary(arch: str, meta: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Phi-3's partial_rotary_factor (Phi-4-mini) from the rotary dimension llama.cpp wrote;
    other architectures rotate whole heads, and a file saying otherwise is refused."""
    rope_dim = meta.get("llama.rope.dimension_count", head_dim)
    if rope_dim == head_dim:
        return {}
    factor = rope_dim / head_dim
    if arch != "phi3" or int(head_dim * factor) != rope_dim:
        raise UnsupportedModelError(
            f"GGUF {arch}.rope.dimension_count {rope_dim} differs from head_dim {head_dim}: partial rotary "
            "embeddings are implemented for phi3 only")
    return {"partial_rotary_factor": factor}


def rope_scaling(
    meta: dict[str, Any], tensors: dict[str, TensorEntry], head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    """None, linear scaling, or the HF llama3 dict recovered from llama.cpp's `rope_freqs` tensor."""
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": f32_to_float(_require(meta, "llama.rope.scaling.factor"))}
    if kind != "none":
        raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported; only linear and "
                                    "llama3 are")
    if ROPE_FREQS_TENSOR not in tensors:
        return None
    stored = dequantize_tensor(tensors[ROPE_FREQS_TENSOR])
    original_context = int(meta.get("llama.rope.scaling.original_context_length", _LLAMA3_ORIGINAL_CONTEXT))
    scaling = {
        "rope_type": "llama3",
        "factor": f32_to_float(stored.max()),
        "low_freq_factor": _LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": _LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": original_context,
    }
    expected = llama3_rope_factors(scaling, head_dim, rope_theta)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-4):
        raise UnsupportedModelError(
            "the GGUF's rope_freqs tensor does not match llama3 rope scaling; "
            "other per-frequency rope factors are not supported"
        )
    return scaling


def llama3_rope_factors(scaling: dict[str, Any], head_dim: int, rope_theta: float) -> np.ndarray:
    """The divisor llama3 scaling applies to each rotary frequency (llama.cpp's rope_freqs)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_context / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen > original_context / low, factor, medium)
    return np.where(wavelen < original_context / high, 1.0, factors).astype(np.float32)


# ---- weights ------------------------------------------------------------------------------


def hf_weights(tensors: dict[str, TensorEntry], config: dict[str, Any],
               progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """Every GGUF tensor as float32 under its HF name, Q/K back in HF (rotate_half) layout."""
    heads = _permuted_heads(config)
    weights = {}
    for done, (name, tensor) in enumerate(tensors.items(), start=1):
        if progress is not None:
            progress(done, len(tensors))
        if name == ROPE_FREQS_TENSOR or name in LONGROPE_TENSORS:
            continue  # folded into config["rope_scaling"]
        values = _hf_norm(name, dequantize_tensor(tensor), config)
        kind = name.split(".")[-2]
        if kind in heads and name.endswith(".weight"):
            values = unpermute_qk(values, heads[kind])
        if kind in _EXPERT_TENSORS:
            weights |= {hf: torch.from_numpy(values[e]) for e, hf in enumerate(expert_names(name, config))}
            continue
        weights[hf_tensor_name(name, config.get("model_type"))] = torch.from_numpy(_hf_shape(name, values))
    check_shapes(weights, config)
    return weights


GGUFTensor = torch.Tensor | QuantizedWeight


def gguf_weights(gguf_path: str | Path, config: dict[str, Any],
                 log_line: Callable[[str], None] | None = None,
                 keep: Callable[[str, GGUFTensor], GGUFTensor] | None = None) -> dict[str, GGUFTensor]:
    """Every tensor under its HF name: a QuantizedWeight where nanoserve has a kernel for its
    block format (the file's bytes, copied once out of its memory map; Q and K rows taken in
    HF order as whole rows of blocks), float32 otherwise. A matrix in a type with no kernel is
    dequantized, and `log_line` hears one line per such type. `keep(name, tensor)`: the part
    to keep of each tensor as it is read (a tensor-parallel rank's shard: then only one whole
    tensor is ever held at a time, and the caller checks the shapes)."""
    heads = _permuted_heads(config)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    dequantized: dict[str, list[str]] = {}
    for tensor in read_tensors(gguf_path):
        if tensor.name == ROPE_FREQS_TENSOR or tensor.name in LONGROPE_TENSORS:
            continue
        kind = tensor.name.split(".")[-2]
        # Matrices stay in their type's bytes (F16 / BF16 too); a vector of one is widened.
        fmt = FORMATS_BY_GGML_TYPE.get(int(tensor.tensor_type)) if len(tensor.shape) >= 2 else None
        if fmt is None:
            values = _hf_shape(tensor.name, _hf_norm(tensor.name, dequantize_tensor(tensor), config))
            if values.ndim >= 2 and tensor.tensor_type.name != "F32":
                dequantized.setdefault(tensor.tensor_type.name, []).append(tensor.name)
            weight = torch.from_numpy(unpermute_qk(values, heads[kind]) if kind in heads else values)
        else:
            *outer, cols = (int(d) for d in reversed(tensor.shape.tolist()))
            rows = math.prod(outer)
            stored = tensor.data.view(np.uint8).reshape(rows, -1)  # F16 / BF16 come typed
            # One copy either way: a row gather for Q and K, a plain copy for the rest.
            blocks = stored[qk_row_order(rows, heads[kind])] if kind in heads else np.array(stored)
            weight = QuantizedWeight(fmt, (rows, cols), torch.from_numpy(blocks))
        for name, part in _hf_parts(tensor.name, weight, config):
            weights[name] = part if keep is None else keep(name, part)
    for type_name, names in dequantized.items():
        if log_line is not None:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            log_line(f"GGUF type {type_name} has no native kernel: {len(names)} matrices dequantized "
                     f"to float32 at load ({shown})")
    if keep is None:
        check_shapes(weights, config)
    return weights


def expert_names(gguf_name: str, config: dict[str, Any]) -> list[str]:
    """The HF names of each expert's slice of a stacked `blk.N.ffn_*_exps` tensor."""
    layer, kind = _LAYER_TENSOR_NAME.fullmatch(gguf_name.rpartition(".")[0]).groups()
    family = config.get("model_type", "llama")
    count = config.get("num_local_experts", config.get("num_experts", 0))
    return [f"model.layers.{layer}.{expert_name(family, e, _EXPERT_TENSORS[kind])}" for e in range(count)]


def _hf_parts(gguf_name: str, weight: GGUFTensor, config: dict[str, Any]) -> list[tuple[str, GGUFTensor]]:
    """A tensor under its HF name, or a stacked experts tensor as each expert's, whole rows each."""
    if gguf_name.split(".")[-2] not in _EXPERT_TENSORS:
        return [(hf_tensor_name(gguf_name, config.get("model_type")), weight)]
    names = expert_names(gguf_name, config)
    if isinstance(weight, torch.Tensor):
        return list(zip(names, weight.unbind(0), strict=True))
    rows, cols = weight.shape[0] // len(names), weight.shape[1]
    return [(name, QuantizedWeight(weight.format, (rows, cols), weight.blocks[e * rows:(e + 1) * rows]))
            for e, name in enumerate(names)]


def _hf_shape(name: str, values: np.ndarray) -> np.ndarray:
    """llama.cpp stores the shared expert's gate as a vector; HF as a [1, hidden] matrix."""
    return values.reshape(1, -1) if name.split(".")[-2] == "ffn_gate_inp_shexp" else values


def _hf_norm(name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Gemma's norms as HF stores them: llama.cpp's converter wrote 1 + w."""
    if config.get("model_type") in GEMMA_MODEL_TYPES and name.endswith("norm.weight"):
        return values - np.float32(1.0)
    return values


def _permuted_heads(config: dict[str, Any]) -> dict[str, int]:
    """The tensors llama.cpp's converter permuted (llama's and Mixtral's Q and K), with their
    head counts."""
    if config.get("model_type", "llama") not in ("llama", "mixtral"):
        return {}
    return {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}


def qk_row_order(rows: int, num_heads: int) -> np.ndarray:
    """Which stored row each HF row of Q or K is: `unpermute_qk` as a row index."""
    return unpermute_qk(np.arange(rows).reshape(rows, 1), num_heads).reshape(rows)


def dequantize_tensor(tensor: TensorEntry) -> np.ndarray:
    # GGUF lists dimensions fastest-varying first; numpy wants them the other way round.
    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    reference = FORMATS_BY_GGML_TYPE.get(int(tensor.tensor_type))
    if reference is not None:  # nanoserve's own reference (tests hold it to gguf's, bit for bit)
        raw = np.ascontiguousarray(tensor.data).view(np.uint8)
        blocks = torch.from_numpy(raw.reshape(-1, reference.bytes).copy())
        return reference.dequantize(blocks).numpy().reshape(shape)
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise UnsupportedModelError(
            f"tensor {tensor.name!r}: {tensor.tensor_type.name} cannot be dequantized"
        ) from err
    # Always copy: the reader hands out read-only views of the memory-mapped file.
    return np.array(values, dtype=np.float32).reshape(shape)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's converter, which interleaves the two rotary halves of each head.

    The converter does reshape(heads, 2, half, cols).swapaxes(1, 2); this swaps them back.
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_tensor_name(gguf_name: str, model_type: str | None = "llama") -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix == "weight" and stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.weight"
    match = _LAYER_TENSOR_NAME.fullmatch(stem)
    names = _LAYER_TENSORS | _LAYER_TENSORS_BY_TYPE.get(model_type or "llama", {})
    if suffix in ("weight", "bias") and match and match[2] in names:
        return f"model.layers.{match[1]}.{names[match[2]]}.{suffix}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in a llama checkpoint")


def check_shapes(weights: dict[str, torch.Tensor] | dict[str, torch.Tensor | QuantizedWeight],
                 config: dict[str, Any]) -> None:
    expected = hf_tensor_shapes(read_model_config(config))
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise UnsupportedModelError(f"GGUF lacks tensors a llama model needs: {missing[:5]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise UnsupportedModelError(
                f"tensor {name} has shape {tuple(weights[name].shape)}; the metadata implies {shape}"
            )


# ---- tokenizer ----------------------------------------------------------------------------


def tokenizer_config(meta: dict[str, Any], tokenizer: GGUFTokenizer) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": tokenizer.add_eos,
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "model_max_length": meta.get("llama.context_length"),
        "clean_up_tokenization_spaces": False,
    }


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """bos and every end token (`gguf_tokenizer.end_token_ids`)."""
    end_ids = end_token_ids(meta)
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": end_ids[0] if len(end_ids) == 1 else end_ids or None,
    }
