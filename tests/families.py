"""Tiny random checkpoints of every family, built by transformers' own config and model
classes and saved with `save_pretrained` (no network), and the harness that runs nanoserve on
them: hand-made batches straight into the model, a paged cache with a trivial allocator.

Weights are redrawn (transformers initializes norms to 1 or 0 and biases to 0, which would hide
a norm read as w instead of 1 + w, or a dropped bias), at a scale where logits are O(1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanoserve.loading.weights import load_weights
from nanoserve.model.batch import AttentionGroup, ForwardBatch
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.kv_cache import KVCache
from nanoserve.model.lora import Adapter, AdapterRows

BLOCK = 4
transformers = None  # imported by `require_transformers`, so this module imports without it


def require_transformers():
    import pytest

    global transformers
    transformers = pytest.importorskip("transformers", reason="the parity tests need transformers "
                                                              "(pip install -e '.[baseline]')")
    transformers.logging.set_verbosity_error()
    return transformers


BASE = {"vocab_size": 211, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}


@dataclass(frozen=True)
class Case:
    """One tiny checkpoint: the transformers config class and what differs from BASE."""

    name: str
    config_class: str
    fields: dict[str, Any] = field(default_factory=dict)
    gguf: str | None = None  # the GGUF architecture, where the family has one

    def config(self):
        return getattr(transformers, self.config_class)(**{**BASE, **self.fields})


def randomize(model, seed: int, gemma: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("norm.weight"):
                p.copy_(0.2 * noise if gemma else 1 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_((0.3 if gemma else 1.0) * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def write_checkpoint(case: Case, path: Path, seed: int = 0):
    """Save the case's random model to `path`; returns the float32 transformers model."""
    config = case.config()
    extra = {"attn_implementation": "eager"}
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra).eval()
    randomize(model, seed, gemma=case.config_class.startswith("Gemma"))
    model.save_pretrained(path)
    return model


def reference_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by full recompute each step (no cache: nothing of transformers' cache
    implementation between the two)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(reference_logits(model, ids).argmax()))
    return ids[len(prompt):]


class Cache:
    """A KV cache plus a trivial block allocator for hand-made batches."""

    def __init__(self, config, num_blocks: int = 96):
        self.kv = KVCache(config, num_blocks, BLOCK, torch.float32, torch.device("cpu"))
        self.next_block = 0
        self.tables: dict[str, list[int]] = {}

    def blocks(self, seq: str, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * BLOCK < num_tokens:
            table.append(self.next_block)
            self.next_block += 1
        return table


def step(model: DecoderLM, cache: Cache, chunks: list[tuple[str, list[int], int]],
         adapters: dict[str, Adapter] | None = None) -> dict[str, torch.Tensor]:
    """chunks: (seq, token_ids, start). Decodes (1 token) first as one group, then each prefill
    chunk as its own; returns each sequence's last-row logits. `adapters`: the LoRA adapter a
    sequence runs with (others: none)."""
    chunks = sorted(chunks, key=lambda c: len(c[1]) > 1)
    decodes = [c for c in chunks if len(c[1]) == 1]
    units = ([decodes] if decodes else []) + [[c] for c in chunks if len(c[1]) > 1]
    ids, positions, slots, groups, last_rows = [], [], [], [], []
    adapter_ranges: dict[int, tuple[Adapter, list[tuple[int, int]]]] = {}
    for unit in units:
        row_start, tables = len(ids), []
        for seq, tokens, start in unit:
            table = cache.blocks(seq, start + len(tokens))
            tables.append(table)
            if adapters and seq in adapters:
                adapter_ranges.setdefault(id(adapters[seq]), (adapters[seq], []))[1].append(
                    (len(ids), len(ids) + len(tokens)))
            for p, token in enumerate(tokens, start):
                ids.append(token)
                positions.append(p)
                slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
            last_rows.append(len(ids) - 1)
        width = max(len(t) for t in tables)
        groups.append(AttentionGroup(
            row_start, len(unit), len(unit[0][1]),
            torch.tensor([list(range(s, s + len(t))) for _, t, s in unit]),
            torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            first_positions=tuple(start for _, _, start in unit)))
    batch = ForwardBatch(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), groups,
                         torch.tensor(last_rows),
                         [AdapterRows(adapter, tuple(spans)) for adapter, spans in adapter_ranges.values()])
    logits = model.forward(batch, cache.kv)
    return {seq: logits[i] for i, (seq, _, _) in enumerate(c for unit in units for c in unit)}


def assert_same_steps(run, other) -> None:
    """Two runs of the same steps, each (outputs per step, cache): every step's outputs for the
    same sequences and every K/V cache bit, equal bit for bit."""
    (outputs, cache), (other_outputs, other_cache) = run, other
    for one, two in zip(outputs, other_outputs, strict=True):
        assert one.keys() == two.keys()
        assert all(torch.equal(one[seq], two[seq]) for seq in one)
    for one, two in zip(cache.kv.k + cache.kv.v, other_cache.kv.k + other_cache.kv.v, strict=True):
        assert torch.equal(one, two)


def crowd_logits(model: DecoderLM, prompts: list[list[int]], crowd: bool) -> list[torch.Tensor]:
    """Six steps of request a (the first prompt): its logits each step, alone or in a crowd
    where b prefills beside it then decodes, and c arrives in chunks later."""
    a, b, c = prompts
    cache, seen, token = Cache(model.config), [], None
    for i in range(6):
        chunks = [("a", a, 0)] if i == 0 else [("a", [token], len(a) + i - 1)]
        if crowd:
            chunks += [("b", b, 0)] if i == 0 else [("b", [3 + i], len(b) + i - 1)]
            if i in (2, 3):
                chunks += [("c", c[(i - 2) * 10:(i - 1) * 10], (i - 2) * 10)]
        logits = step(model, cache, chunks)["a"]
        seen.append(logits)
        token = int(logits.argmax())
    return seen


def load_model(path: Path, *, batch_invariant: bool = True, native: bool = True, gguf: Path | None = None,
               ) -> DecoderLM:
    config, weights = load_weights(path, dtype=torch.float32, device=torch.device("cpu"), gguf=gguf)
    if weights.is_quantized():
        weights = weights.dequantized()
    return DecoderLM(config, weights, batch_invariant=batch_invariant, native=native)


def prefill_logits(model: DecoderLM, prompt: list[int], chunk: int | None = None) -> torch.Tensor:
    cache = Cache(model.config)
    chunk = chunk or len(prompt)
    for start in range(0, len(prompt), chunk):
        out = step(model, cache, [("a", prompt[start:start + chunk], start)])
    return out["a"]


def greedy(model: DecoderLM, prompt: list[int], steps: int) -> list[int]:
    cache = Cache(model.config)
    token = int(step(model, cache, [("a", prompt, 0)])["a"].argmax())
    tokens = [token]
    for i in range(steps - 1):
        token = int(step(model, cache, [("a", [token], len(prompt) + i)])["a"].argmax())
        tokens.append(token)
    return tokens


_EXPERT_STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                  "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's LlamaModel.permute: each head's rotary halves interleaved."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _add_experts_metadata(writer, config: dict) -> None:
    """The `{arch}.expert_*` keys llama.cpp's converter writes for a mixture of experts."""
    count = config.get("num_experts") or config.get("num_local_experts")
    if not count:
        return
    writer.add_expert_count(count)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _add_matrix(writer, gguf_name: str, values: np.ndarray, matrix_type) -> None:
    """A tensor as float32, or a matrix (a stack of experts' too) in `matrix_type(gguf_name)`."""
    tensor_type = matrix_type(gguf_name) if matrix_type is not None and values.ndim >= 2 else None
    if tensor_type is None:
        writer.add_tensor(gguf_name, values)
        return
    from tiny_model import gguf_blocks

    rows = gguf_blocks(values.reshape(-1, values.shape[-1]), tensor_type)
    writer.add_tensor(gguf_name, rows.reshape(*values.shape[:-1], -1), raw_dtype=tensor_type)


def write_gguf(hf_dir: Path, path: Path, architecture: str, extra_metadata=None, expert_type=None,
               matrix_type=None) -> Path:
    """The checkpoint as llama.cpp's converter (convert_hf_to_gguf.py) writes a GGUF of
    `architecture`, float32, with a stand-in byte-level vocabulary: Q/K rows in HF's layout
    (only llama permutes them), Gemma's norms as 1 + w and its softcaps and window in the
    metadata, Phi-3's fused matrices under attn_qkv / ffn_up and its LongRoPE factors as tensors,
    Phi-4-mini's partial rotary as a rope.dimension_count below the head size;
    a mixture of experts' router as ffn_gate_inp, its experts stacked [experts, rows, cols] as
    ffn_{gate,up,down}_exps, Qwen2-MoE's shared expert as ffn_*_shexp (Mixtral is llama with
    experts: its Q/K rows permuted as llama.cpp's converter does), in `expert_type` blocks
    (quantized by the `gguf` package) where it is given. `matrix_type`: a GGUF name -> the type
    that matrix is written in (None: float32), as llama-quantize mixes them (tiny_model's
    gguf_blocks: random blocks where the `gguf` package cannot quantize)."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), architecture)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _add_experts_metadata(writer, config)
    if extra_metadata is not None:  # a test's own keys: extra_metadata(writer)
        extra_metadata(writer)
    rope = config["rope_parameters"]
    full = rope.get("full_attention", rope)
    writer.add_rope_freq_base(full["rope_theta"])
    if full.get("partial_rotary_factor", 1.0) != 1.0:
        writer.add_rope_dimension_count(int(head_dim * full["partial_rotary_factor"]))
    if full["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            getattr(writer, f"add_{key}")(config[key])
    if full["rope_type"] == "longrope":
        original = full["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            factors = np.array(full[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    tokens = ["a", "b", "ab"] + [f"<t{i}>" for i in range(3, config["vocab_size"])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    gemma = architecture.startswith("gemma")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "post_attention_norm" if gemma else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
             "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        stem, _, suffix = name.rpartition(".")
        values = tensor.float().numpy().copy()
        part = stem
        if stem in top:
            gguf_name = f"{top[stem]}.{suffix}"
        else:
            _, _, layer, part = stem.split(".", 3)
            if ".experts." in part:  # mlp.experts.E.gate_proj / block_sparse_moe.experts.E.w1
                _, _, expert, proj = part.split(".")
                experts.setdefault(f"blk.{layer}.{_EXPERT_STACKS[proj]}.{suffix}", {})[int(expert)] = values
                continue
            gguf_name = f"blk.{layer}.{names[part]}.{suffix}"
        if gemma and name.endswith("norm.weight"):
            values = values + np.float32(1.0)
        if architecture == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads" if part == "self_attn.q_proj" else "num_key_value_heads"]
            values = _permute_qk(values, heads)
        _add_matrix(writer, gguf_name, values, matrix_type)
    for gguf_name, stack in experts.items():
        values = np.stack([stack[e] for e in sorted(stack)])
        if expert_type is None:
            _add_matrix(writer, gguf_name, values, matrix_type)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, expert_type), raw_dtype=expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
