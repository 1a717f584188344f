"""Hugging Face tensor names: every tensor a checkpoint of each family holds, with its shape,
and how those tensors become a decoder's weights. The one map every loader (safetensors,
GGUF, tensor-parallel shards) checks against and builds from.

A sparse layer's experts are read under the per-expert names save_pretrained writes (transformers
5 fuses them into 3-D `experts.gate_up_proj` parameters in memory, and unfuses them on save):
`mlp.gate`, `mlp.experts.N.{gate,up,down}_proj` and Qwen2-MoE's `mlp.shared_expert.*` and
`mlp.shared_expert_gate`; Mixtral's `block_sparse_moe.gate` and `block_sparse_moe.experts.N.w1`
(gate), `w3` (up), `w2` (down)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve import quant
from nanoserve.config import ModelConfig
from nanoserve.model.rope import qkv_row_order
from nanoserve.model.weights import LayerWeights, LlamaWeights, MoEWeights
from nanoserve.quant import QuantizedWeight, Weight

_GATE_UP = ("gate_proj", "up_proj")
# Mixtral's names for an expert's gate, up and down projections.
_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def moe_prefix(family: str) -> str:
    """Where a sparse layer's router and experts live under `model.layers.N.`."""
    return "block_sparse_moe." if family == "mixtral" else "mlp."


def expert_name(family: str, expert: int, proj: str) -> str:
    """An expert's projection (gate_proj, up_proj, down_proj) under `model.layers.N.`."""
    if family == "mixtral":
        return f"block_sparse_moe.experts.{expert}.{_MIXTRAL_EXPERT[proj]}.weight"
    return f"mlp.experts.{expert}.{proj}.weight"


def _moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    experts, hidden = config.experts, config.hidden_size
    width = experts.intermediate_size
    family = config.family
    shapes = {moe_prefix(family) + "gate.weight": (experts.count, hidden)}
    for e in range(experts.count):
        shapes |= {expert_name(family, e, "gate_proj"): (width, hidden),
                   expert_name(family, e, "up_proj"): (width, hidden),
                   expert_name(family, e, "down_proj"): (hidden, width)}
    shared = experts.shared_intermediate_size
    if shared:
        shapes |= {"mlp.shared_expert.gate_proj.weight": (shared, hidden),
                   "mlp.shared_expert.up_proj.weight": (shared, hidden),
                   "mlp.shared_expert.down_proj.weight": (hidden, shared),
                   "mlp.shared_expert_gate.weight": (1, hidden)}
    return shapes


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `config`'s family holds, with its shape."""
    hidden, ffn, dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_heads * dim, config.num_kv_heads * dim
    layer: dict[str, tuple[int, ...]] = {"self_attn.o_proj.weight": (hidden, q_rows),
                                         "mlp.down_proj.weight": (hidden, ffn),
                                         "input_layernorm.weight": (hidden,),
                                         "post_attention_layernorm.weight": (hidden,)}
    if config.family == "phi3":
        layer |= {"self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
                  "mlp.gate_up_proj.weight": (2 * ffn, hidden)}
    else:
        layer |= {"self_attn.q_proj.weight": (q_rows, hidden), "self_attn.k_proj.weight": (kv_rows, hidden),
                  "self_attn.v_proj.weight": (kv_rows, hidden), "mlp.gate_proj.weight": (ffn, hidden),
                  "mlp.up_proj.weight": (ffn, hidden)}
    if config.qkv_bias:
        layer |= {"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                  "self_attn.v_proj.bias": (kv_rows,)}
    if config.o_bias:
        layer["self_attn.o_proj.bias"] = (hidden,)
    if config.mlp_bias:
        layer |= {"mlp.gate_proj.bias": (ffn,), "mlp.up_proj.bias": (ffn,), "mlp.down_proj.bias": (hidden,)}
    if config.qk_norm:
        per_head = config.qk_norm_per_head
        layer |= {"self_attn.q_norm.weight": (dim if per_head else q_rows,),
                  "self_attn.k_norm.weight": (dim if per_head else kv_rows,)}
    if config.gemma_norms:
        layer |= {"pre_feedforward_layernorm.weight": (hidden,),
                  "post_feedforward_layernorm.weight": (hidden,)}
    attention_and_norms = {n: s for n, s in layer.items() if not n.startswith("mlp.")}
    sparse = attention_and_norms | (_moe_shapes(config) if config.experts else {})
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        names = sparse if config.is_sparse(i) else layer
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in names.items()}
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings and config.has_lm_head:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def weights_from_hf(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> LlamaWeights:
    """The weights under their Hugging Face names (`hf_tensor_shapes` lists them). Gemma's
    norms scale by (1 + w): the 1 is added here, in float32, once. Where RoPE rotates part of
    each head, the q and k rows are stored in `rope.rotary_head_order` (rope.py says why)."""
    order = qkv_row_order(config)

    def rotary_rows(weight: Weight) -> Weight:
        if order is None:
            return weight
        # Phi-3 (the one family with partial rotary) fuses q, k and v: never a QuantizedStack.
        return weight.rows(order) if isinstance(weight, QuantizedWeight) else weight[order]

    def norm(name: str) -> torch.Tensor:
        return tensors[name].float() + 1.0 if config.gemma_norms else tensors[name]

    def optional(name: str, present: bool, read: Callable[[str], torch.Tensor] = tensors.__getitem__):
        return read(name) if present else None

    def stacked(names: list[str]) -> torch.Tensor:
        return torch.cat([tensors[n] for n in names])

    def experts(p: str) -> MoEWeights:
        def gate_up(e: int) -> torch.Tensor:
            return quant.stack_rows([tensors[p + expert_name(config.family, e, x)] for x in _GATE_UP])

        count, shared = config.experts.count, p + "mlp.shared_expert."
        has_shared = bool(config.experts.shared_intermediate_size)
        shared_gate_up = [tensors[shared + x + ".weight"] for x in _GATE_UP] if has_shared else []
        return MoEWeights(
            router=tensors[p + moe_prefix(config.family) + "gate.weight"],
            gate_up=[gate_up(e) for e in range(count)],
            down=[tensors[p + expert_name(config.family, e, "down_proj")] for e in range(count)],
            top_k=config.experts.top_k,
            shared_gate_up=quant.stack_rows(shared_gate_up) if has_shared else None,
            shared_down=optional(shared + "down_proj.weight", has_shared),
            shared_gate=optional(p + "mlp.shared_expert_gate.weight", has_shared))

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        fused = config.family == "phi3"
        gemma = config.gemma_norms
        sparse = config.is_sparse(i)
        qkv_names = [attn + f"{x}_proj" for x in "qkv"]
        gate_up_names = [mlp + "gate_proj", mlp + "up_proj"]
        return LayerWeights(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=rotary_rows(tensors[attn + "qkv_proj.weight"] if fused else quant.stack_rows(
                [tensors[n + ".weight"] for n in qkv_names])),
            o=tensors[attn + "o_proj.weight"],
            post_norm=norm(p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm")
                           + ".weight"),
            gate_up=None if sparse else tensors[mlp + "gate_up_proj.weight"] if fused else quant.stack_rows(
                [tensors[n + ".weight"] for n in gate_up_names]),
            down=None if sparse else tensors[mlp + "down_proj.weight"],
            qkv_bias=rotary_rows(stacked([n + ".bias" for n in qkv_names])) if config.qkv_bias else None,
            o_bias=optional(attn + "o_proj.bias", config.o_bias),
            gate_up_bias=stacked([n + ".bias" for n in gate_up_names]) if config.mlp_bias else None,
            down_bias=optional(mlp + "down_proj.bias", config.mlp_bias),
            q_norm=optional(attn + "q_norm.weight", config.qk_norm, norm),
            k_norm=optional(attn + "k_norm.weight", config.qk_norm, norm),
            attn_out_norm=optional(p + "post_attention_layernorm.weight", gemma, norm),
            mlp_out_norm=optional(p + "post_feedforward_layernorm.weight", gemma, norm),
            moe=experts(p) if sparse else None,
        )

    embed = tensors["model.embed_tokens.weight"]
    # A headless checkpoint (an embedding model) pools and never samples (the engine refuses to
    # generate with it): the embedding table stands in where the head's place is.
    tied = config.tie_word_embeddings or not config.has_lm_head
    lm_head = embed if tied else tensors["lm_head.weight"]
    layers = [layer(i) for i in range(config.num_layers)]
    return LlamaWeights(embed, layers, norm("model.norm.weight"), lm_head)
