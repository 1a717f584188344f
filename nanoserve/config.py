"""Configuration: what the model is (from config.json, read by `weights`) and how the engine runs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The Llama-family hyperparameters, in Hugging Face `config.json` terms."""

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

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        num_heads = raw["num_attention_heads"]
        rope_scaling = raw.get("rope_scaling")
        # Only llama3-style scaling changes the frequencies we compute; "default" is none.
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=raw.get("rope_theta", 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
        )

    @property
    def num_params(self) -> int:
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    @property
    def matmul_params(self) -> int:
        """Weights multiplied per token: every linear layer and the output head.

        The input embedding is a row lookup, so an untied one is not multiplied; a tied one is
        the head. These are also the bytes a decode step must stream from memory.
        """
        norms = (2 * self.num_layers + 1) * self.hidden_size
        embedding_lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_params - norms - embedding_lookup

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs for one token: 2 per weight, plus QK^T and PV over the context."""
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context_len
        return 2.0 * self.matmul_params + attention


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs: where, in what precision, and how much it may batch and cache."""

    model: str | None = None
    dtype: str = "float32"
    device: str | None = None  # None: cuda when available, else cpu
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_gb: float | None = None  # None: kv_cache_fraction of free memory
    kv_cache_fraction: float = 0.25
    num_kv_blocks: int | None = None  # an exact pool size (tests use tiny pools)
    # A request's tokens and logprobs do not depend on what shares its steps (DESIGN invariant 1).
    batch_invariant: bool = True
    # Reuse the K/V of prompt prefixes already computed (automatic prefix caching).
    enable_prefix_caching: bool = True
    linear_kernel: str | None = None  # None: the fastest that qualifies, measured at start-up
    threads: int | None = None  # CPU threads; None: every core this process may run on
