"""Configuration: what the model is (from config.json, read by `weights`) and how the engine runs it.

`ModelConfig.from_hf_dict` is the one reader of a Hugging Face config. It accepts a field only
where this engine computes what the field says: a value it does not implement (biases, another
activation, a RoPE scaling type, a sliding window, experts, a quantization scheme) is refused
with an `UnsupportedModelError` naming the field and its value, never defaulted. Fields that do
not change the forward (token ids, training-time settings, bookkeeping) are listed as such; any
other field is refused too, so a checkpoint of a newer or different design cannot load and
silently compute something else. Both config styles are read: transformers 4's top-level
`rope_theta` / `rope_scaling` and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.errors import UnsupportedModelError

# Fields that do not change the forward pass: token ids, training-only settings, and what
# transformers writes into every config. `pretraining_tp` only split Llama's training matmuls.
_INERT_FIELDS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "initializer_range", "attention_dropout", "pretraining_tp", "output_attentions",
    "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "torchscript", "use_return_dict", "tie_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "finetuning_task", "pruned_heads", "tf_legacy_loss",
    "use_bfloat16", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})
# Fields the reader turns into ModelConfig values below.
_READ_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings",
})
# Fields whose value changes the forward: each is accepted at the value listed (the one this
# engine computes), and refused at any other.
_ONLY_VALUE = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "use_sliding_window": (False,),
    "partial_rotary_factor": (1.0, 1),
    "quantization_config": (None,),
    "num_local_experts": (None, 0, 1),
    "num_experts": (None, 0, 1),
}
# RoPE types whose frequencies `model.rope_inv_freq` computes.
IMPLEMENTED_ROPE_TYPES = ("default", "llama3")
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
}


def _refuse(field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json field {field!r} = {value!r}: {why}")


def _check_fields(raw: dict[str, Any]) -> None:
    for field, value in raw.items():
        if field in _INERT_FIELDS or field in _READ_FIELDS:
            continue
        if field in _ONLY_VALUE:
            if value not in _ONLY_VALUE[field] or isinstance(value, bool) != isinstance(
                    _ONLY_VALUE[field][0], bool):
                accepted = " or ".join(repr(v) for v in _ONLY_VALUE[field])
                raise _refuse(field, value, f"nanoserve implements only {accepted}")
        elif field == "sliding_window":
            _check_sliding_window(raw, value)
        elif field == "layer_types":
            other = sorted(set(value) - {"full_attention"})
            if other:
                raise _refuse(field, other, "only full attention layers are implemented")
        else:
            raise _refuse(field, value, "nanoserve does not implement this field, and will not "
                                        "run a model whose config it cannot honour")


def _check_sliding_window(raw: dict[str, Any], window: Any) -> None:
    # A window at least as long as the model's context never hides a position: no window at all.
    if window is None or raw.get("use_sliding_window") is False:
        return
    context = raw.get("max_position_embeddings", 2048)
    if not isinstance(window, int) or window < context:
        raise _refuse("sliding_window", window,
                      f"a sliding attention window shorter than the context ({context}) is not implemented")


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config style; refuses what is not implemented."""
    parameters = raw.get("rope_parameters")
    if parameters is not None and "rope_theta" not in parameters and "rope_type" not in parameters:
        # transformers 5 keys parameters by layer type when the model has several kinds of layer.
        if set(parameters) != {"full_attention"}:
            raise _refuse("rope_parameters", sorted(parameters), "per-layer-type RoPE is not implemented")
        parameters = parameters["full_attention"]
    legacy = raw.get("rope_scaling")
    if parameters is not None and legacy is not None and not _same_rope(legacy, parameters):
        raise _refuse("rope_scaling", legacy, f"contradicts rope_parameters {parameters!r}")
    scaling = dict(parameters if parameters is not None else legacy or {})
    theta = scaling.get("rope_theta", raw.get("rope_theta", 10000.0))
    if "rope_theta" in scaling and "rope_theta" in raw and raw["rope_theta"] != theta:
        raise _refuse("rope_theta", raw["rope_theta"], f"contradicts rope_parameters' {theta!r}")
    field = "rope_parameters" if parameters is not None else "rope_scaling"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in IMPLEMENTED_ROPE_TYPES:
        raise _refuse(field, scaling, f"RoPE type {kind!r} is not implemented "
                                      f"(nanoserve implements {', '.join(IMPLEMENTED_ROPE_TYPES)})")
    unknown = sorted(set(scaling) - _ROPE_KEYS[kind])
    if unknown:
        raise _refuse(field, scaling, f"RoPE parameters {unknown} are not implemented for type {kind!r}")
    if kind == "default":
        return float(theta), None
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    scaling["rope_type"] = kind
    return float(theta), scaling


def _same_rope(legacy: dict[str, Any], parameters: dict[str, Any]) -> bool:
    def kind(d: dict[str, Any]) -> str:
        return d.get("rope_type", d.get("type", "default"))

    return kind(legacy) == kind(parameters) and all(
        parameters.get(key) == value for key, value in legacy.items() if key not in ("type", "rope_type"))


def _check_shapes(raw: dict[str, Any], num_heads: int, num_kv_heads: int) -> None:
    hidden = raw["hidden_size"]
    if raw.get("head_dim") is None and hidden % num_heads:
        raise UnsupportedModelError(
            f"config.json: hidden_size {hidden} is not divisible by num_attention_heads {num_heads} "
            "and there is no head_dim")
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"config.json: num_attention_heads {num_heads} is not divisible by "
            f"num_key_value_heads {num_kv_heads}")


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
        """The config, or an UnsupportedModelError naming the first field not implemented here."""
        _check_fields(raw)
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        _check_shapes(raw, num_heads, num_kv_heads)
        rope_theta, rope_scaling = _rope(raw)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
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


# The default of EngineConfig.max_prefill_tokens_while_decoding (the CLI reads it here).
MAX_PREFILL_TOKENS_WHILE_DECODING = 16
# Deferred output (EngineConfig.async_scheduling=None) per device type: off everywhere until a
# side-by-side measurement shows it pays there; the one place to flip it.
ASYNC_SCHEDULING_DEFAULT: dict[str, bool] = {"cpu": False, "cuda": False}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs: where, in what precision, and how much it may batch and cache."""

    model: str | None = None
    # auto: a GGUF in its own quantization on a CPU with native kernels, else float32 on CPU
    # and bfloat16 on CUDA; float32 / bfloat16 / float16; quantized (a GGUF's blocks).
    dtype: str = "auto"
    quantize: str | None = None  # q8_0 or q4_0: quantize a float checkpoint's matrices at load
    device: str | None = None  # None: cuda when available, else cpu
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    # While any request decodes, a step computes at most this many prompt tokens, so a long
    # prompt slows the decodes beside it by a bounded factor (measured: results/README.md).
    max_prefill_tokens_while_decoding: int = MAX_PREFILL_TOKENS_WHILE_DECODING
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
    # Speculative decoding (exact: tokens and logprobs as without it, under batch invariance):
    # up to this many drafts per request per step, 0 off; proposed by prompt lookup over
    # n-grams of speculative_ngram_max down to speculative_ngram_min tokens.
    speculative_tokens: int = 0
    speculative_method: str = "ngram"
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    # speculative_method "draft": the small model (same tokenizer and vocabulary) that proposes
    # the drafts, greedily, from its own KV cache.
    draft_model: str | None = None
    # Deferred output (vLLM's --async-scheduling): step N+1 is launched before step N's tokens
    # are resolved on the host. None: ASYNC_SCHEDULING_DEFAULT for the device.
    async_scheduling: bool | None = None
