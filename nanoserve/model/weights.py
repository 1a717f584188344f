"""The weights of a decoder in memory: each layer's matrices (dense tensors or GGUF blocks,
q/k/v and gate/up stacked) and the switches' vectors; conversions between their forms."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve import quant
from nanoserve.model.linear import LinearKernel, ProbeShape
from nanoserve.quant import QuantizedWeight, Weight


@dataclass(slots=True)
class LayerWeights:
    """A layer's matrices: dense tensors, or GGUF blocks (nanoserve.quant) for quantized runs."""

    input_norm: torch.Tensor
    qkv: Weight  # q, k and v projections stacked: one GEMM instead of three
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight  # gate and up stacked
    down: Weight
    # The switches' tensors (None where the family has none): biases of the stacked matrices,
    # q/k head norms, and Gemma's norms of the attention and MLP outputs.
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None

    def matrices(self) -> list[Weight]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def with_matrices(self, convert: Callable[[Weight], Weight],
                      vector: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> LayerWeights:
        """The same layer with every matrix through `convert` and every vector through `vector`."""
        vectors = {f: None if getattr(self, f) is None else vector(getattr(self, f)) for f in _LAYER_VECTORS}
        return LayerWeights(qkv=convert(self.qkv), o=convert(self.o), gate_up=convert(self.gate_up),
                            down=convert(self.down), **vectors)


_LAYER_VECTORS = ("input_norm", "post_norm", "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norm",
                  "k_norm", "attn_out_norm", "mlp_out_norm")


@dataclass(slots=True)
class LlamaWeights:
    embed: Weight
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Weight  # the embedding itself when tied

    def to(self, dtype: torch.dtype, device: torch.device) -> LlamaWeights:
        """Dense tensors in `dtype` on `device`; quantized matrices stay as they are (CPU)."""
        def move(t: Weight) -> Weight:
            if quant.is_quantized(t):
                return t
            return t.to(device=device, dtype=dtype).contiguous()

        tied = self.lm_head is self.embed
        embed = move(self.embed)
        layers = [w.with_matrices(move, move) for w in self.layers]
        return LlamaWeights(embed, layers, move(self.norm), embed if tied else move(self.lm_head))

    def quantized(self, format_name: str) -> LlamaWeights:
        """Every matrix and the token table quantized to `format_name` (--quantize); norms stay."""
        def convert(w: Weight) -> QuantizedWeight:
            return quant.quantize(quant.dense(w), format_name)

        embed = convert(self.embed)
        layers = [w.with_matrices(convert) for w in self.layers]
        head = embed if self.lm_head is self.embed else convert(self.lm_head)
        return LlamaWeights(embed, layers, self.norm, head)

    def dequantized(self) -> LlamaWeights:
        """Every quantized matrix as float32 (where no native kernel runs them)."""
        embed = quant.dense(self.embed)
        layers = [w.with_matrices(quant.dense) for w in self.layers]
        head = embed if self.lm_head is self.embed else quant.dense(self.lm_head)
        return LlamaWeights(embed, layers, self.norm, head)

    def is_quantized(self) -> bool:
        return any(quant.is_quantized(m) for m in [self.embed, self.lm_head, *self.layers[0].matrices()])

    def nbytes(self) -> int:
        """Bytes the weights hold (a tied head counted once)."""
        matrices = [self.embed, self.norm, *(m for w in self.layers for m in w.matrices()),
                    *(v for w in self.layers for f in _LAYER_VECTORS if (v := getattr(w, f)) is not None)]
        if self.lm_head is not self.embed:
            matrices.append(self.lm_head)
        return sum(m.nbytes for m in matrices)

    def packed_for(self, kernel: LinearKernel) -> LlamaWeights:
        """The same weights with every matrix in `kernel`'s layout; the embedding stays a table,
        unless it is the head's and the head's layout serves lookups (then it is kept once)."""
        layers = [w.with_matrices(kernel.pack) for w in self.layers]
        head = kernel.pack(self.lm_head)
        tied = self.lm_head is self.embed and quant.serves_lookups(head)
        return LlamaWeights(head if tied else self.embed, layers, self.norm, head)

    def probe_shape(self) -> ProbeShape:
        """The linears a forward runs, for measuring kernels on the model's own weights."""
        return ProbeShape([[w.qkv, w.o, w.gate_up, w.down] for w in self.layers], self.lm_head)
