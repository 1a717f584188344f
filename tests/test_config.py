"""Config reading: every field that changes the forward is computed as it says, or refused by name.

The configs below are the dicts transformers 5.24 writes (`LlamaConfig(...).to_diff_dict()`,
`MistralConfig(...)`), and the transformers 4 style they replaced, so no test needs transformers.
"""

import pytest

from nanoserve.config import ModelConfig
from nanoserve.errors import UnsupportedModelError

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
    assert ModelConfig.from_hf_dict(config()).rope_theta == 100000.0


def test_transformers_4_top_level_rope_theta_is_read():
    legacy = config(rope_parameters=..., rope_theta=500000.0, rope_scaling=None)
    parsed = ModelConfig.from_hf_dict(legacy)
    assert (parsed.rope_theta, parsed.rope_scaling) == (500000.0, None)


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_llama3_scaling_is_read_from_either_config_style(style):
    if style == "rope_parameters":
        raw = config(rope_parameters={**LLAMA3_PARAMETERS, "rope_theta": 500000.0})
    else:
        raw = config(rope_parameters=..., rope_theta=500000.0, rope_scaling=LLAMA3_PARAMETERS)
    parsed = ModelConfig.from_hf_dict(raw)
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling == LLAMA3_PARAMETERS


@pytest.mark.parametrize(("changes", "field"), [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_parameters"),
    ({"rope_parameters": ..., "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4},
     "sliding_window"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                          "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}},
     "rope_parameters"),
    ({"some_future_switch": True}, "some_future_switch"),
])
def test_a_field_not_implemented_is_refused_by_name(changes, field):
    with pytest.raises(UnsupportedModelError, match=f"'{field}'"):
        ModelConfig.from_hf_dict(config(**changes))


def test_a_sliding_window_no_shorter_than_the_context_is_no_window():
    mistral = config(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=2048)
    assert ModelConfig.from_hf_dict(mistral).max_position_embeddings == 2048
    assert ModelConfig.from_hf_dict(config(sliding_window=None)).num_layers == 2


def test_rope_theta_that_contradicts_rope_parameters_is_refused():
    with pytest.raises(UnsupportedModelError, match="'rope_theta'"):
        ModelConfig.from_hf_dict(config(rope_theta=10000.0))


@pytest.mark.parametrize(("changes", "named"), [
    ({"head_dim": ..., "hidden_size": 66}, "hidden_size 66"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3"),
])
def test_contradictory_head_counts_are_refused_naming_both(changes, named):
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_hf_dict(config(**changes))
