"""Reading a Hugging Face `config.json` (or a GGUF's metadata, which `gguf` turns into one) into
the `ModelConfig` the engine runs: the one reader of a checkpoint's hyperparameters.

It accepts a field only
where this engine computes what the field says: a value it does not implement (another
activation, a RoPE scaling type, experts, a quantization scheme, partial rotary embeddings
outside Phi-3's family) is refused with an `UnsupportedModelError` naming the field and its
value, never defaulted.
Fields that do not change the forward (token ids, training-time settings, bookkeeping) are
listed as such; any other field is refused too, so a checkpoint of a newer or different design
cannot load and silently compute something else. Both config styles are read: transformers 4's
top-level `rope_theta` / `rope_scaling` and transformers 5's `rope_parameters` (per layer type
where it has one).

Families (`FAMILIES`): llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3 (text), and the
mixtures of experts qwen2_moe, qwen3_moe, mixtral, olmoe. Each is the Llama forward with a few
named switches (`ModelConfig`'s fields below the Llama ones); the family decides which fields
its config may carry and what the switches are. A mixture of experts (`Experts`) routes each
row by softmax over its router, top-k, renormalised where the family does it
(`norm_topk_prob`; always for Mixtral); Qwen2-MoE adds a shared expert behind a sigmoid gate;
`decoder_sparse_step` and `mlp_only_layers` say which layers are sparse. Router kinds other
than softmax (`scoring_func`) and expert-parallel fields are refused by name.

Refuses: holding engine settings (`nanoserve.config`) or reading tensors (`weights`, `gguf`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanoserve.config.model import Experts, ModelConfig, Rope
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
    # dropout probabilities (Phi-3) and cache hints (Gemma 2) act only in training / in HF's cache
    "resid_pdrop", "embd_pdrop", "cache_implementation", "_sliding_window_pattern",
    # where trust_remote_code would find modeling code (Phi-3): nanoserve runs its own
    "auto_map",
})
# Fields every family reads into ModelConfig values.
_READ_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "layer_types", "sliding_window",
    "mrope_section",
})
# Fields whose value changes the forward, accepted only at the values listed, in every family.
_ONLY_VALUE = {
    "partial_rotary_factor": (1.0, 1),
    "quantization_config": (None,),
    "num_local_experts": (None, 0, 1),
    "num_experts": (None, 0, 1),
    "use_bidirectional_attention": (None, False),
    # DeepSeek-style routers (sigmoid scores, group-limited top-k, scaled weights) and expert
    # parallelism: nanoserve routes by softmax over every expert, all experts on every rank.
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "routed_scaling_factor": (1.0, 1),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "expert_parallel_size": (None, 1),
    "moe_ep_size": (None, 1),
    "attention_bias": (False,),
    "mlp_bias": (False,),
}
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
# What every mixture-of-experts config may say: the expert count under either spelling, the
# top-k, and what acts only in training (the auxiliary loss, the router's jitter).
_MOE_FIELDS: dict[str, tuple[Any, ...] | None] = {
    "num_experts": None, "num_local_experts": None, "num_experts_per_tok": None,
    "output_router_logits": None, "router_aux_loss_coef": None, "router_jitter_noise": None}
# ... and the Qwen MoE families: the experts' width, renormalisation, which layers are sparse.
_QWEN_MOE_FIELDS = _MOE_FIELDS | {"moe_intermediate_size": None, "norm_topk_prob": (True, False),
                                  "decoder_sparse_step": None, "mlp_only_layers": None,
                                  "use_sliding_window": (False,), "max_window_layers": None}
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True)
class Family:
    """What one architecture's config.json may say, beyond the Llama fields every family reads.

    `fields`: accepted extra fields -> the values accepted (None: any value, read below).
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    fields: dict[str, tuple[Any, ...] | None] = field(default_factory=dict)

    @property
    def headless_architectures(self) -> tuple[str, ...]:
        """transformers' base-model classes (`Qwen3Model`): a checkpoint saved from one has no
        output head and its tensors no `model.` prefix, as embedding models are published."""
        return tuple(a.removesuffix("ForCausalLM") + "Model" for a in self.architectures)


_ANY = None
FAMILIES = (
    Family("llama", ("llama",), ("LlamaForCausalLM",),
           {"hidden_act": ACTIVATIONS, "attention_bias": (True, False), "mlp_bias": (True, False)}),
    Family("mistral", ("mistral",), ("MistralForCausalLM",), {"hidden_act": ACTIVATIONS}),
    Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",),
           # transformers gives Qwen2's q/k/v biases whatever attention_bias says
           {"hidden_act": ACTIVATIONS, "use_sliding_window": (True, False), "max_window_layers": _ANY,
            "attention_bias": _ANY}),
    Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",),
           {"hidden_act": ACTIVATIONS, "attention_bias": (True, False), "use_sliding_window": (True, False),
            "max_window_layers": _ANY}),
    # Phi-4-mini rotates a fraction of each head (partial_rotary_factor, read below) and writes
    # three fields transformers' Phi3 never reads, at the values its own code assumed.
    Family("phi3", ("phi3",), ("Phi3ForCausalLM",),
           {"hidden_act": ACTIVATIONS, "original_max_position_embeddings": _ANY,
            "partial_rotary_factor": _ANY, "full_attn_mod": (1,), "interpolate_factor": (1,),
            "lm_head_bias": (False,)}),
    Family("gemma2", ("gemma2",), ("Gemma2ForCausalLM",),
           {"hidden_act": ACTIVATIONS, "hidden_activation": ACTIVATIONS, "attention_bias": (False,),
            "query_pre_attn_scalar": _ANY, "attn_logit_softcapping": _ANY, "final_logit_softcapping": _ANY,
            "sliding_window_size": _ANY}),
    Family("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",),
           {"hidden_act": ACTIVATIONS, "hidden_activation": ACTIVATIONS, "attention_bias": (False,),
            "query_pre_attn_scalar": _ANY, "attn_logit_softcapping": _ANY, "final_logit_softcapping": _ANY,
            "rope_local_base_freq": _ANY, "sliding_window_pattern": _ANY}),
    # transformers 5's Qwen2-MoE says qkv_bias (true unless stated); older configs do not
    Family("qwen2_moe", ("qwen2_moe",), ("Qwen2MoeForCausalLM",),
           _QWEN_MOE_FIELDS | {"hidden_act": ACTIVATIONS, "qkv_bias": (True, False),
                               "shared_expert_intermediate_size": _ANY}),
    Family("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",),
           _QWEN_MOE_FIELDS | {"hidden_act": ACTIVATIONS, "attention_bias": (True, False)}),
    Family("mixtral", ("mixtral",), ("MixtralForCausalLM",), _MOE_FIELDS | {"hidden_act": ACTIVATIONS}),
    # OLMoE norms q and k over the whole projection, not per head; clip_qkv is not implemented
    Family("olmoe", ("olmoe",), ("OlmoeForCausalLM",),
           _MOE_FIELDS | {"hidden_act": ACTIVATIONS, "attention_bias": (True, False),
                          "norm_topk_prob": (True, False), "clip_qkv": (None,)}),
)
FAMILY_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
FAMILY_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in (*f.architectures, *f.headless_architectures)}
# Checkpoints of these designs hold vision/audio towers: refused by name.
_MULTIMODAL_FIELDS = ("vision_config", "audio_config", "text_config", "vision_tower", "mm_projector_type")


def _refuse(field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json field {field!r} = {value!r}: {why}")


def family_of(raw: dict[str, Any]) -> Family:
    """The family `model_type` (or else `architectures`) names; refused naming both otherwise."""
    for name in _MULTIMODAL_FIELDS:
        if raw.get(name) is not None:
            raise _refuse(name, "...", "multimodal checkpoints are not supported: nanoserve runs text "
                                       "decoders (a Gemma 3 text checkpoint is model_type 'gemma3_text')")
    model_type = raw.get("model_type")
    architectures = list(raw.get("architectures") or [])
    family = FAMILY_BY_MODEL_TYPE.get(model_type)
    if family is None and model_type is None:
        family = next((FAMILY_BY_ARCHITECTURE[a] for a in architectures if a in FAMILY_BY_ARCHITECTURE), None)
    if family is None:
        supported = ", ".join(t for f in FAMILIES for t in f.model_types)
        raise UnsupportedModelError(
            f"config.json: model_type {model_type!r} / architectures {architectures} is not supported; "
            f"nanoserve runs {supported}")
    other = [a for a in architectures if a not in (*family.architectures, *family.headless_architectures)]
    if other:
        raise _refuse("architectures", architectures,
                      f"model_type {model_type!r} runs as {family.architectures[0]} only")
    return family


def _has_lm_head(raw: dict[str, Any], family: Family) -> bool:
    """Whether the checkpoint has an output head: not when it names only base-model classes
    (a tied head is the embedding table, which every checkpoint has)."""
    architectures = raw.get("architectures") or []
    headless = bool(architectures) and all(a in family.headless_architectures for a in architectures)
    return not headless or raw.get("tie_word_embeddings", False)


def _check_fields(raw: dict[str, Any], family: Family) -> None:
    for name, value in raw.items():
        if name in _INERT_FIELDS or name in _READ_FIELDS:
            continue
        accepted = family.fields[name] if name in family.fields else _ONLY_VALUE.get(name, ...)
        if accepted is ...:
            raise _refuse(name, value, f"nanoserve does not implement this field for {family.name}, "
                                       "and will not run a model whose config it cannot honour")
        if accepted is not _ANY and (value not in accepted or any(
                isinstance(value, bool) != isinstance(a, bool) for a in accepted if a == value)):
            raise _refuse(name, value, "nanoserve implements only " + " or ".join(repr(v) for v in accepted))


# RoPE types whose frequencies `rope_frequencies` computes, and the keys each may carry.
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    # transformers recomputes dynamic NTK frequencies only past max_position_embeddings, which
    # is the longest context nanoserve runs: inside it they are the default ones.
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "original_max_position_embeddings", "truncate"},
    "longrope": {"factor", "attention_factor", "short_factor", "long_factor",
                 "original_max_position_embeddings"},
}
IMPLEMENTED_ROPE_TYPES = tuple(_ROPE_KEYS)


def _rope_parameters(raw: dict[str, Any], layer_types: set[str]) -> dict[str, dict[str, Any] | None]:
    """Layer type -> that type's RoPE dict as the config states it (None: top-level fields)."""
    parameters = raw.get("rope_parameters")
    if parameters is None or "rope_theta" in parameters or "rope_type" in parameters or "type" in parameters:
        return {kind: parameters for kind in layer_types}
    unknown = sorted(set(parameters) - set(ATTENTION_LAYER_TYPES))
    missing = sorted(layer_types - set(parameters))
    if unknown or missing:
        raise _refuse("rope_parameters", sorted(parameters),
                      f"per-layer-type RoPE must name exactly the layer types {sorted(layer_types)}")
    return {kind: parameters[kind] for kind in layer_types}


def _rope(raw: dict[str, Any], parameters: dict[str, Any] | None, *, local: bool = False) -> Rope:
    """One layer type's Rope from either config style; refuses what is not implemented."""
    legacy = raw.get("rope_scaling")
    if local and parameters is None and raw.get("model_type") == "gemma3_text":
        return Rope(float(raw.get("rope_local_base_freq", 10000.0)))  # Gemma 3's sliding layers: never scaled
    if parameters is not None and legacy is not None and not _same_rope(legacy, parameters) and not local:
        raise _refuse("rope_scaling", legacy, f"contradicts rope_parameters {parameters!r}")
    scaling = dict(parameters if parameters is not None else legacy or {})
    theta = scaling.get("rope_theta", raw.get("rope_theta", 10000.0))
    if "rope_theta" in scaling and "rope_theta" in raw and raw["rope_theta"] != theta and not local:
        raise _refuse("rope_theta", raw["rope_theta"], f"contradicts rope_parameters' {theta!r}")
    name = "rope_parameters" if parameters is not None else "rope_scaling"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_KEYS:
        raise _refuse(name, scaling, f"RoPE type {kind!r} is not implemented "
                                     f"(nanoserve implements {', '.join(IMPLEMENTED_ROPE_TYPES)})")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0 and raw.get("model_type") != "phi3":
        raise _refuse(name, scaling, "partial rotary embeddings are implemented for phi3 only")
    unknown = sorted(set(scaling) - _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta",
                                                        "partial_rotary_factor"})
    if unknown:
        raise _refuse(name, scaling, f"RoPE parameters {unknown} are not implemented for type {kind!r}")
    if kind == "default":
        return Rope(float(theta))
    out = {"rope_type": kind, **{k: v for k, v in scaling.items() if k in _ROPE_KEYS[kind]}}
    if kind in ("yarn", "longrope") and "original_max_position_embeddings" not in out:
        out["original_max_position_embeddings"] = raw.get("original_max_position_embeddings",
                                                          raw.get("max_position_embeddings", 2048))
    if kind == "longrope":
        if out.get("factor") is None:  # transformers: the extension ratio of max_position_embeddings
            out["factor"] = raw.get("max_position_embeddings", 2048) / out["original_max_position_embeddings"]
        half = _rotary_dim(raw) // 2
        for key in ("short_factor", "long_factor"):
            if len(out.get(key) or ()) != half:
                raise _refuse(name, scaling, f"longrope needs {key} of rotary dims / 2 = {half} values")
    return Rope(float(theta), out)


def _mrope_section(raw: dict[str, Any], rotary_dim: int) -> tuple[int, ...]:
    """M-RoPE's split of the rotated pairs over (temporal, height, width): a vision-language
    checkpoint's, moved beside its RoPE by `model.vision_config.text_config_dict`."""
    section = raw.get("mrope_section")
    if section is None:
        return ()
    if (not isinstance(section, list | tuple) or len(section) != 3
            or not all(isinstance(n, int) and n > 0 for n in section) or sum(section) != rotary_dim // 2):
        raise _refuse("mrope_section", section,
                      f"expected three positive counts summing to {rotary_dim // 2} (the rotated dims / 2)")
    return tuple(section)


def _same_rope(legacy: dict[str, Any], parameters: dict[str, Any]) -> bool:
    def kind(d: dict[str, Any]) -> str:
        return d.get("rope_type", d.get("type", "default"))

    return kind(legacy) == kind(parameters) and all(
        parameters.get(key) == value for key, value in legacy.items() if key not in ("type", "rope_type"))


def _head_dim(raw: dict[str, Any]) -> int:
    return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]


def _rotary_dim(raw: dict[str, Any]) -> int:
    """How many of each head's first dims RoPE rotates: int(head_dim * partial_rotary_factor),
    as transformers computes it, from either config style (rope_parameters holds it in 5)."""
    parameters = raw.get("rope_parameters") or {}
    factor = parameters.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise _refuse("partial_rotary_factor", factor, "expected a number in (0, 1]")
    if raw.get("partial_rotary_factor", factor) != factor:
        raise _refuse("partial_rotary_factor", raw["partial_rotary_factor"],
                      f"contradicts rope_parameters' {factor!r}")
    dim = int(_head_dim(raw) * factor)
    if dim % 2 or dim < 2:
        raise _refuse("partial_rotary_factor", factor, f"rotates {dim} dims of {_head_dim(raw)}: "
                                                       "rotary embeddings need an even, nonzero count")
    return dim


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
    if _head_dim(raw) % 2:
        raise _refuse("head_dim", _head_dim(raw), "rotary embeddings need an even head_dim")


_QWEN_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _layer_types(raw: dict[str, Any], family: Family) -> list[str]:
    """Each layer's attention type, as transformers 5 derives it when the config has no list."""
    layers = raw["num_hidden_layers"]
    stated = raw.get("layer_types")
    if stated is not None:
        other = sorted(set(stated) - set(ATTENTION_LAYER_TYPES))
        if other or len(stated) != layers:
            raise _refuse("layer_types", stated, f"expected {layers} entries of {ATTENTION_LAYER_TYPES}")
        return list(stated)
    window = raw.get("sliding_window")
    if family.name in _QWEN_FAMILIES:
        sliding = window is not None and raw.get("use_sliding_window", False)
        first = raw.get("max_window_layers", 28)
        return ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(layers)]
    if family.name in ("gemma2", "gemma3"):
        pattern = 2 if family.name == "gemma2" else raw.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if family.name in ("mistral", "phi3", "mixtral") and window is not None:
        return ["sliding_attention"] * layers
    if window is not None and family.name in ("llama", "olmoe"):
        raise _refuse("sliding_window", window, f"{family.name} has no sliding window (a Mistral checkpoint "
                                                "says model_type 'mistral')")
    return ["full_attention"] * layers


def _window(raw: dict[str, Any], family: Family, types: list[str], context: int) -> int:
    """The sliding layers' window in positions; 0 when it is no shorter than the context (then
    it hides nothing) or there is none."""
    window = raw.get("sliding_window")
    if raw.get("sliding_window_size", window) != window:  # Gemma 2's older spelling, kept beside
        raise _refuse("sliding_window_size", raw["sliding_window_size"],
                      f"contradicts sliding_window {window!r}")
    if family.name in _QWEN_FAMILIES and not raw.get("use_sliding_window", False):
        return 0  # transformers drops the window unless use_sliding_window says otherwise
    if "sliding_attention" in types and window is None:
        raise _refuse("layer_types", types, "sliding layers but no sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise _refuse("sliding_window", window, "expected a positive number of positions")
    if window is None or window >= context or "sliding_attention" not in types:
        return 0
    return window


def _softcap(raw: dict[str, Any], name: str) -> float:
    value = raw.get(name)
    if value is None:
        return 0.0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise _refuse(name, value, "expected a positive number or null")
    return float(value)


def _family_switches(raw: dict[str, Any], family: Family, head_dim: int) -> dict[str, Any]:
    name = family.name
    gemma = name in ("gemma2", "gemma3")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    stated = raw.get("hidden_activation")
    if stated is not None and raw.get("hidden_act") not in (None, stated):
        raise _refuse("hidden_act", raw["hidden_act"], f"contradicts hidden_activation {stated!r}")
    bias = bool(raw.get("attention_bias", False)) and name != "qwen2"
    qkv_bias = bias or name == "qwen2" or (name == "qwen2_moe" and bool(raw.get("qkv_bias", True)))
    scalar = raw.get("query_pre_attn_scalar") if gemma else None
    if scalar is not None and (not isinstance(scalar, (int, float)) or scalar <= 0):
        raise _refuse("query_pre_attn_scalar", scalar, "expected a positive number")
    return {
        "family": name,
        "qkv_bias": qkv_bias,
        "o_bias": bias,
        "mlp_bias": bool(raw.get("mlp_bias", False)),
        "hidden_act": act,
        "qk_norm": name in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
        "qk_norm_per_head": name != "olmoe",
        "gemma_norms": gemma,
        "attn_softcap": _softcap(raw, "attn_logit_softcapping") if gemma else 0.0,
        "final_softcap": _softcap(raw, "final_logit_softcapping") if gemma else 0.0,
        "attention_scale": float(scalar) ** -0.5 if scalar is not None else head_dim ** -0.5,
    }


def _positive_int(raw: dict[str, Any], name: str, default: Any = None) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(name, value, "expected a positive integer")
    return value


def _experts(raw: dict[str, Any], family: Family) -> Experts | None:
    """The experts of a mixture-of-experts family (None for the dense ones), as transformers
    builds them: Qwen's sparse layers are every decoder_sparse_step-th but mlp_only_layers."""
    if family.name not in ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe"):
        return None
    count_field = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    count = _positive_int(raw, count_field)
    top_k = _positive_int(raw, "num_experts_per_tok")
    if top_k > count:
        raise _refuse("num_experts_per_tok", top_k, f"more than the {count} experts")
    layers = raw["num_hidden_layers"]
    qwen = family.name in _QWEN_FAMILIES
    step = _positive_int(raw, "decoder_sparse_step", 1) if qwen else 1
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise _refuse("mlp_only_layers", dense, f"expected layer indices below {layers}")
    shared = _positive_int(raw, "shared_expert_intermediate_size") if family.name == "qwen2_moe" else 0
    return Experts(
        count=count, top_k=top_k,
        intermediate_size=_positive_int(raw, "moe_intermediate_size") if qwen else raw["intermediate_size"],
        renormalize=family.name == "mixtral" or bool(raw.get("norm_topk_prob", False)),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
        shared_intermediate_size=shared)


def _context(raw: dict[str, Any], ropes: list[Rope]) -> int:
    """The longest context computed as transformers computes it. LongRoPE switches every
    position of a batch to its long factors once any sequence passes the original context
    (a batch-dependent switch): nanoserve runs the short factors, up to that context."""
    context = raw.get("max_position_embeddings", 2048)
    for rope in ropes:
        if rope.scaling and rope.scaling["rope_type"] == "longrope":
            context = min(context, rope.scaling["original_max_position_embeddings"])
    return context


def read_model_config(raw: dict[str, Any]) -> ModelConfig:
    """The config, or an UnsupportedModelError naming the first field not implemented here."""
    family = family_of(raw)
    _check_fields(raw, family)
    num_heads = raw["num_attention_heads"]
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    _check_shapes(raw, num_heads, num_kv_heads)
    head_dim = _head_dim(raw)
    rotary_dim = _rotary_dim(raw)
    types = _layer_types(raw, family)
    parameters = _rope_parameters(raw, set(types))
    full = _rope(raw, parameters.get("full_attention", parameters.get("sliding_attention")))
    local = full
    if "sliding_attention" in parameters:
        local = _rope(raw, parameters["sliding_attention"], local=True)
    context = _context(raw, [full, local])
    window = _window(raw, family, types, context)
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=context,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=full.theta,
        rope_scaling=full.scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", family.name in ("gemma2", "gemma3")),
        sliding_layers=tuple(t == "sliding_attention" for t in types) if local != full or window else (),
        sliding_window=window,
        local_rope=local if local != full else None,
        experts=_experts(raw, family),
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        has_lm_head=_has_lm_head(raw, family),
        mrope_section=_mrope_section(raw, rotary_dim),
        **_family_switches(raw, family, head_dim),
    )
