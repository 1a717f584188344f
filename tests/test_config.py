"""Config reading: every field that changes the forward is computed as it says, or refused by name.

The configs below are the dicts transformers 5.24 writes (`LlamaConfig(...).to_diff_dict()`,
`MistralConfig(...)`), and the transformers 4 style they replaced, so no test needs transformers.
"""

import pytest

from nanoserve.errors import UnsupportedModelError
from nanoserve.loading.hf_config import read_model_config

# What transformers 5.24 saves for a tiny Llama (rope_parameters, no top-level rope_theta).
TRANSFORMERS_5_LLAMA = {
    "transformers_version": "5.24.0", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
    "use_cache": True, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1,
    "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "head_dim": 16,
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "dtype": "float32",
}
LLAMA3_PARAMETERS = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}


def config(**changes):
    raw = {**TRANSFORMERS_5_LLAMA, **changes}
    return {k: v for k, v in raw.items() if v is not ...}


def test_transformers_5_rope_parameters_theta_is_read():
    assert read_model_config(config()).rope_theta == 100000.0


def test_transformers_4_top_level_rope_theta_is_read():
    legacy = config(rope_parameters=..., rope_theta=500000.0, rope_scaling=None)
    parsed = read_model_config(legacy)
    assert (parsed.rope_theta, parsed.rope_scaling) == (500000.0, None)


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_llama3_scaling_is_read_from_either_config_style(style):
    if style == "rope_parameters":
        raw = config(rope_parameters={**LLAMA3_PARAMETERS, "rope_theta": 500000.0})
    else:
        raw = config(rope_parameters=..., rope_theta=500000.0, rope_scaling=LLAMA3_PARAMETERS)
    parsed = read_model_config(raw)
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling == LLAMA3_PARAMETERS


@pytest.mark.parametrize(("changes", "field"), [
    ({"rope_parameters": {"rope_type": "mrope", "factor": 2.0, "rope_theta": 10000.0}}, "rope_parameters"),
    ({"rope_parameters": ..., "rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "beta_medium": 3}},
     "rope_parameters"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"hidden_act": "gelu_new"}, "hidden_act"),
    ({"attention_bias": 1}, "attention_bias"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                          "chunked_attention": {"rope_theta": 1e4, "rope_type": "default"}}},
     "rope_parameters"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "attention_bias": ..., "mlp_bias": ...,
      "query_pre_attn_scalar": 64},
     "query_pre_attn_scalar"),
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "mlp_bias": ...,
      "use_bidirectional_attention": True},
     "use_bidirectional_attention"),
    ({"model_type": "qwen2", "architectures": ["LlamaForCausalLM"]}, "architectures"),
    ({"vision_config": {"hidden_size": 8}}, "vision_config"),
    ({"some_future_switch": True}, "some_future_switch"),
])
def test_a_field_not_implemented_is_refused_by_name(changes, field):
    with pytest.raises(UnsupportedModelError, match=f"'{field}'"):
        read_model_config(config(**changes))


def test_a_sliding_window_no_shorter_than_the_context_is_no_window():
    mistral = config(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=2048)
    assert read_model_config(mistral).sliding_window == 0
    assert read_model_config(config(sliding_window=None)).sliding_window == 0


def test_a_mistral_window_shorter_than_the_context_slides_every_layer():
    mistral = read_model_config(config(model_type="mistral", architectures=["MistralForCausalLM"],
                                              sliding_window=4))
    assert [mistral.window(i) for i in range(2)] == [4, 4]


def test_an_unknown_model_type_is_refused_naming_it():
    with pytest.raises(UnsupportedModelError, match="'deepseek_v3'"):
        read_model_config(config(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"]))


def test_longrope_runs_the_original_context_where_transformers_uses_the_short_factors():
    half = 8
    raw = config(model_type="phi3", architectures=["Phi3ForCausalLM"], max_position_embeddings=8192,
                 original_max_position_embeddings=2048, head_dim=...,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * half,
                                  "long_factor": [2.0] * half})
    raw = {k: v for k, v in raw.items() if k not in ("attention_bias", "mlp_bias")}
    parsed = read_model_config(raw)
    assert parsed.max_position_embeddings == 2048
    assert parsed.rope_scaling["factor"] == 4.0


def test_rope_theta_that_contradicts_rope_parameters_is_refused():
    with pytest.raises(UnsupportedModelError, match="'rope_theta'"):
        read_model_config(config(rope_theta=10000.0))


@pytest.mark.parametrize(("changes", "named"), [
    ({"head_dim": ..., "hidden_size": 66}, "hidden_size 66"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3"),
])
def test_contradictory_head_counts_are_refused_naming_both(changes, named):
    with pytest.raises(UnsupportedModelError, match=named):
        read_model_config(config(**changes))


# The config.json fields of published checkpoints (values abridged where they do not matter).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
PHI3_MINI_4K = {
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config"},
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096,
    "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.2",
    "use_cache": True, "vocab_size": 32064}
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2",
    "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}

# Phi-4-mini-instruct's config.json, its 48 + 48 LongRoPE factors replaced by stand-ins.
PHI4_MINI = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 199999, "embd_pdrop": 0.0, "eos_token_id": 199999, "full_attn_mod": 1,
    "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
    "interpolate_factor": 1, "lm_head_bias": False, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "phi3", "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "original_max_position_embeddings": 4096, "pad_token_id": 199999, "partial_rotary_factor": 0.75,
    "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [1.0 + i for i in range(48)], "short_factor": [1.0] * 48,
                     "type": "longrope"},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0", "use_cache": True, "vocab_size": 200064}


def test_phi4_mini_rotates_three_quarters_of_each_head_with_longrope():
    phi4 = read_model_config(PHI4_MINI)
    assert (phi4.head_dim, phi4.rotary_dim, phi4.rotated_dims) == (128, 96, 96)
    assert phi4.rope_scaling["rope_type"] == "longrope" and phi4.max_position_embeddings == 4096
    assert read_model_config(PHI3_MINI_4K).rotated_dims == 96  # all of 3072 / 32


@pytest.mark.parametrize(("changes", "field"), [
    ({"rope_scaling": {**PHI4_MINI["rope_scaling"], "short_factor": [1.0] * 64}}, "rope_scaling"),
    ({"partial_rotary_factor": 0.7}, "partial_rotary_factor"),  # 89.6 -> 89 dims: odd
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"full_attn_mod": 2}, "full_attn_mod"),
    ({"lm_head_bias": True}, "lm_head_bias"),
])
def test_phi4_mini_values_it_does_not_implement_are_refused_by_name(changes, field):
    with pytest.raises(UnsupportedModelError, match=f"'{field}'"):
        read_model_config({**PHI4_MINI, **changes})


def test_partial_rotary_in_rope_parameters_outside_phi3_is_refused():
    raw = config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="'rope_parameters'"):
        read_model_config(raw)


def test_published_configs_load_with_their_switches():
    qwen = read_model_config(QWEN25_05B)
    assert (qwen.family, qwen.qkv_bias, qwen.o_bias, qwen.sliding_window) == ("qwen2", True, False, 0)
    phi = read_model_config(PHI3_MINI_4K)
    assert (phi.family, phi.sliding_window, phi.window(0)) == ("phi3", 2047, 2047)
    gemma2 = read_model_config(GEMMA2_2B)
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.tie_word_embeddings) == (50.0, 30.0, True)
    assert [gemma2.window(i) for i in range(3)] == [4096, 0, 4096]
    assert gemma2.attention_scale == 256 ** -0.5
    gemma3 = read_model_config(GEMMA3_1B)
    assert [gemma3.window(i) for i in range(6)] == [512] * 5 + [0]
    assert (gemma3.rope_of(0).theta, gemma3.rope_of(5).theta, gemma3.qk_norm) == (10000.0, 1000000.0, True)


def test_gemma3_with_its_vision_tower_is_refused_naming_the_field():
    with pytest.raises(UnsupportedModelError, match="'vision_config'"):
        read_model_config({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                                  "text_config": {"hidden_size": 2560},
                                  "vision_config": {"hidden_size": 1152}})
