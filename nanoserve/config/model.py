"""What the model is: its hyperparameters in Hugging Face `config.json` terms and each family's
switches (`ModelConfig`), its rotary embeddings (`Rope`) and experts (`Experts`).

Refuses: reading a checkpoint's config (`nanoserve.loading.hf_config` reads config.json and
GGUF metadata into these) and engine settings (the other modules of `nanoserve.config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Rope:
    """One rotary embedding: base theta and a scaling dict (rope_type first) or None."""

    theta: float
    scaling: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Experts:
    """A mixture-of-experts MLP: `count` gated MLPs of `intermediate_size`, `top_k` of them run
    per row, weighted by the softmax of the router's logits over all experts (those top-k
    weights divided by their sum when `renormalize`), plus a shared expert on every row behind
    a sigmoid gate where `shared_intermediate_size` is set. Layers not in `sparse_layers` run
    the dense MLP of the config's intermediate_size."""

    count: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    shared_intermediate_size: int = 0  # 0: none


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The hyperparameters, in Hugging Face `config.json` terms, and each family's switches."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    # The switches (all off: Llama). Weight layouts follow `family` (Phi-3's fused matrices).
    family: str = "llama"
    qkv_bias: bool = False  # q, k and v projections have biases (Qwen2; attention_bias)
    o_bias: bool = False  # the output projection too (Llama / Qwen3 attention_bias)
    mlp_bias: bool = False  # gate, up and down have biases
    hidden_act: str = "silu"  # the gate's activation
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    qk_norm_per_head: bool = True  # False: one RMSNorm over all of q and all of k (OLMoE)
    # Gemma: RMSNorm scaled by (1 + weight), norms after attention and MLP too, embedding
    # multiplied by sqrt(hidden_size).
    gemma_norms: bool = False
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0  # the same on the logits
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # Layers of the sliding type attend to their last `sliding_window` positions (0: no window
    # shorter than the context) and rotate by `local_rope` where it is set (Gemma 3).
    sliding_layers: tuple[bool, ...] = ()  # (): none
    sliding_window: int = 0
    local_rope: Rope | None = None
    experts: Experts | None = None  # a mixture of experts in place of the MLP on its sparse layers
    # RoPE rotates each head's first `rotary_dim` dims and passes the rest (Phi-4-mini's
    # partial_rotary_factor); 0: the whole head.
    rotary_dim: int = 0
    # False for a checkpoint of a base-model class (`Qwen3Model`: an embedding model): it has
    # no output head of its own and can only pool (EngineConfig.task "embed").
    has_lm_head: bool = True
    # M-RoPE (Qwen2-VL, Qwen2.5-VL): each token's (temporal, height, width) positions, the
    # rotated pairs split into these many for each axis in turn (summing to rotated_dims / 2);
    # (): one position per token. A token of text has all three equal: plain RoPE.
    mrope_section: tuple[int, ...] = ()

    @property
    def is_plain_llama(self) -> bool:
        """Every switch off: the layers are the Llama stack and nothing else (Phi-3 without a
        window too: its fused matrices are a load-time layout, its RoPE lives in the tables)."""
        return self.is_llama_stack and not self.experts

    @property
    def runs_in_one_call(self) -> bool:
        """Whether the one-call decoder's stages (csrc/stages/decoder.c) compute every layer: the
        Llama stack and the switches they take (q/k head norms, Gemma's norms, soft-capped
        scores, windows, per-layer RoPE, any attention scale, GELU's tanh form); not biases, one
        norm over all of q (OLMoE), exact GELU, a shared expert."""
        one_norm_over_q = self.qk_norm and not self.qk_norm_per_head
        return (not (self.qkv_bias or self.o_bias or self.mlp_bias or one_norm_over_q
                     or (self.experts and self.experts.shared_intermediate_size))
                and self.hidden_act in ("silu", "gelu_pytorch_tanh"))

    @property
    def is_llama_stack(self) -> bool:
        """Every switch off but the MLP's kind: the Llama stack, its MLPs dense or routed
        experts (Mixtral; a shared expert is a family's switch too, Qwen2-MoE's)."""
        return (not (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm or self.gemma_norms
                     or self.attn_softcap or self.final_softcap or self.sliding_window or self.local_rope
                     or (self.experts and self.experts.shared_intermediate_size))
                and self.hidden_act == "silu" and self.attention_scale in (None, self.head_dim ** -0.5))

    def window(self, layer: int) -> int:
        """How many last positions `layer` attends to; 0: all of them."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` routes its rows to experts (else it runs the dense MLP)."""
        return self.experts is not None and self.experts.sparse_layers[layer]

    @property
    def kv_window(self) -> int:
        """The window every layer attends within, so K/V before it is never read again; 0 when
        some layer sees the whole context (Gemma 2/3 mix full layers in: they keep it all)."""
        if self.sliding_layers and all(self.sliding_layers):
            return self.sliding_window
        return 0

    @property
    def rotated_dims(self) -> int:
        """How many of each head's dims RoPE rotates (the first ones, in the HF layout)."""
        return self.rotary_dim or self.head_dim

    def rope_of(self, layer: int) -> Rope:
        if self.local_rope is not None and self.sliding_layers[layer]:
            return self.local_rope
        return Rope(self.rope_theta, self.rope_scaling)

    def _params(self, *, active: bool) -> int:
        """Every weight (active: only the experts a row runs, `top_k` of them)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + 2 * h
        layers = 0
        for layer in range(self.num_layers):
            layers += attention + (self._moe_params(active) if self.is_sparse(layer) else 3 * h * i)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + layers + h + head

    def _moe_params(self, active: bool) -> int:
        e, h = self.experts, self.hidden_size
        routed = (e.top_k if active else e.count) * 3 * h * e.intermediate_size
        shared = 3 * h * e.shared_intermediate_size + h if e.shared_intermediate_size else 0
        return e.count * h + routed + shared

    @property
    def num_params(self) -> int:
        return self._params(active=False)

    @property
    def matmul_params(self) -> int:
        """Weights multiplied per token: every linear layer and the output head (of a mixture
        of experts, the router and the top_k experts a row runs).

        The input embedding is a row lookup, so an untied one is not multiplied; a tied one is
        the head. These are also the bytes a decode step must stream from memory.
        """
        norms = (2 * self.num_layers + 1) * self.hidden_size
        embedding_lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self._params(active=True) - norms - embedding_lookup

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs for one token: 2 per weight, plus QK^T and PV over the context."""
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context_len
        return 2.0 * self.matmul_params + attention
