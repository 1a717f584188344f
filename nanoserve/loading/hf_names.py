"""Hugging Face tensor names: every tensor a checkpoint of each family holds, with its shape,
and how those tensors become a decoder's weights. The one map every loader (safetensors,
GGUF, tensor-parallel shards) checks against and builds from."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve import quant
from nanoserve.config import ModelConfig
from nanoserve.model.rope import qkv_row_order
from nanoserve.model.weights import LayerWeights, LlamaWeights
from nanoserve.quant import QuantizedWeight, Weight


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
        layer |= {"self_attn.q_norm.weight": (dim,), "self_attn.k_norm.weight": (dim,)}
    if config.gemma_norms:
        layer |= {"pre_feedforward_layernorm.weight": (hidden,),
                  "post_feedforward_layernorm.weight": (hidden,)}
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
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

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        fused = config.family == "phi3"
        gemma = config.gemma_norms
        qkv_names = [attn + f"{x}_proj" for x in "qkv"]
        gate_up_names = [mlp + "gate_proj", mlp + "up_proj"]
        return LayerWeights(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=rotary_rows(tensors[attn + "qkv_proj.weight"] if fused else quant.stack_rows(
                [tensors[n + ".weight"] for n in qkv_names])),
            o=tensors[attn + "o_proj.weight"],
            post_norm=norm(p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm")
                           + ".weight"),
            gate_up=tensors[mlp + "gate_up_proj.weight"] if fused else quant.stack_rows(
                [tensors[n + ".weight"] for n in gate_up_names]),
            down=tensors[mlp + "down_proj.weight"],
            qkv_bias=rotary_rows(stacked([n + ".bias" for n in qkv_names])) if config.qkv_bias else None,
            o_bias=optional(attn + "o_proj.bias", config.o_bias),
            gate_up_bias=stacked([n + ".bias" for n in gate_up_names]) if config.mlp_bias else None,
            down_bias=optional(mlp + "down_proj.bias", config.mlp_bias),
            q_norm=optional(attn + "q_norm.weight", config.qk_norm, norm),
            k_norm=optional(attn + "k_norm.weight", config.qk_norm, norm),
            attn_out_norm=optional(p + "post_attention_layernorm.weight", gemma, norm),
            mlp_out_norm=optional(p + "post_feedforward_layernorm.weight", gemma, norm),
        )

    embed = tensors["model.embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else tensors["lm_head.weight"]
    layers = [layer(i) for i in range(config.num_layers)]
    return LlamaWeights(embed, layers, norm("model.norm.weight"), lm_head)
