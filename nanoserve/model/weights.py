"""The weights of a decoder in memory: each layer's matrices (dense tensors or GGUF blocks,
q/k/v and gate/up stacked), a sparse layer's router and experts (`MoEWeights`, each expert's
gate/up stacked like the dense MLP's) and the switches' vectors; conversions between their
forms. The router and the shared expert's gate stay in float under --quantize, as llama.cpp
keeps `ffn_gate_inp`: a rounded router would move rows to other experts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve import quant
from nanoserve.model.linear import LinearKernel, ProbeShape
from nanoserve.quant import QuantizedWeight, Weight

Convert = Callable[[Weight], Weight]


@dataclass(slots=True)
class MoEWeights:
    """A sparse layer's MLP: the router [experts, hidden], every expert's gate/up [2 * width,
    hidden] and down [hidden, width], and Qwen2-MoE's shared expert with its gate [1, hidden].
    `top_k`: how many experts a row runs (what the kernel probe multiplies)."""

    router: Weight
    gate_up: list[Weight]
    down: list[Weight]
    top_k: int
    shared_gate_up: Weight | None = None
    shared_down: Weight | None = None
    shared_gate: Weight | None = None

    def matrices(self) -> list[Weight]:
        shared = [m for m in (self.shared_gate_up, self.shared_down, self.shared_gate) if m is not None]
        return [self.router, *self.gate_up, *self.down, *shared]

    def with_matrices(self, convert: Convert, router: Convert | None = None) -> MoEWeights:
        """Every matrix through `convert`, the two gates through `router` (default: `convert`)."""
        router = router or convert

        def optional(m: Weight | None, how: Convert) -> Weight | None:
            return None if m is None else how(m)

        return MoEWeights(router(self.router), [convert(m) for m in self.gate_up],
                          [convert(m) for m in self.down], self.top_k, optional(self.shared_gate_up, convert),
                          optional(self.shared_down, convert), optional(self.shared_gate, router))

    def probe(self) -> list[Weight]:
        """The matrices one row multiplies: the router, top_k experts, the shared expert."""
        shared = [m for m in (self.shared_gate_up, self.shared_down, self.shared_gate) if m is not None]
        experts = [m for e in range(self.top_k) for m in (self.gate_up[e], self.down[e])]
        return [self.router, *experts, *shared]


@dataclass(slots=True)
class LayerWeights:
    """A layer's matrices: dense tensors, or GGUF blocks (nanoserve.quant) for quantized runs."""

    input_norm: torch.Tensor
    qkv: Weight  # q, k and v projections stacked: one GEMM instead of three
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight | None  # gate and up stacked (None on a sparse layer)
    down: Weight | None
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
    moe: MoEWeights | None = None  # a sparse layer's experts, in place of gate_up and down

    def matrices(self) -> list[Weight]:
        mlp = self.moe.matrices() if self.moe is not None else [self.gate_up, self.down]
        return [self.qkv, self.o, *mlp]

    def with_matrices(self, convert: Convert, vector: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                      router: Convert | None = None) -> LayerWeights:
        """The same layer with every matrix through `convert` (a router through `router`,
        default `convert`) and every vector through `vector`."""
        vectors = {f: None if getattr(self, f) is None else vector(getattr(self, f)) for f in _LAYER_VECTORS}
        dense = self.moe is None
        return LayerWeights(qkv=convert(self.qkv), o=convert(self.o),
                            gate_up=convert(self.gate_up) if dense else None,
                            down=convert(self.down) if dense else None,
                            moe=None if dense else self.moe.with_matrices(convert, router), **vectors)

    def probe(self) -> list[Weight]:
        """The matrices one row of this layer multiplies, in forward order."""
        mlp = self.moe.probe() if self.moe is not None else [self.gate_up, self.down]
        return [self.qkv, self.o, *mlp]


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
        layers = [w.with_matrices(convert, router=lambda t: t) for w in self.layers]
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

    def packed_for(self, kernel: LinearKernel, threads: int | None = None) -> LlamaWeights:
        """The same weights with every matrix in `kernel`'s layout (packed on `threads` threads);
        the embedding stays a table, unless it is the head's and the head's layout serves lookups
        (then it is kept once)."""
        pack = functools.partial(kernel.pack, threads=threads)
        layers = [w.with_matrices(pack) for w in self.layers]
        head = pack(self.lm_head)
        tied = self.lm_head is self.embed and quant.serves_lookups(head)
        return LlamaWeights(head if tied else self.embed, layers, self.norm, head)

    def probe_shape(self) -> ProbeShape:
        """The linears a forward runs, for measuring kernels on the model's own weights (of a
        sparse layer, the router and the experts one row runs). Layer 0 holds every distinct
        shape of the model, which is what the kernel's self-test reads."""
        layers = [w.probe() for w in self.layers]
        shapes = {tuple(m.shape): m for layer in layers for m in layer}
        in_first = {tuple(m.shape) for m in layers[0]}
        first = layers[0] + [m for shape, m in shapes.items() if shape not in in_first]
        return ProbeShape([first, *layers[1:]], self.lm_head)
