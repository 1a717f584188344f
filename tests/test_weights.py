"""Loading checkpoint directories: single or sharded, tied or untied, and clear refusals."""

import json

import pytest
import torch

from nanoserve.errors import ModelNotFoundError, UnsupportedModelError
from nanoserve.llm import LLM
from nanoserve.loading.weights import load_llama, load_state_dict, read_config


def load(path, **kwargs):
    return load_llama(path, dtype=torch.float32, device=torch.device("cpu"), **kwargs)


def test_sharded_checkpoint_loads_the_same_tensors_as_a_single_file(tmp_path):
    from tiny_model import write_tiny_llama

    single = load_state_dict(write_tiny_llama(tmp_path / "single", seed=3))
    sharded = load_state_dict(write_tiny_llama(tmp_path / "sharded", seed=3, shards=3))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)


def test_untied_head_is_its_own_tensor_and_tied_head_is_the_embedding(tiny_model_dir, tiny_model_dir_untied):
    tied, untied = load(tiny_model_dir), load(tiny_model_dir_untied)
    assert tied.weights.lm_head is tied.weights.embed
    assert untied.weights.lm_head is not untied.weights.embed
    assert not torch.equal(untied.weights.lm_head, untied.weights.embed)


def test_untied_model_generates(tiny_model_dir_untied):
    from nanoserve.sampling_params import SamplingParams

    completion = LLM(str(tiny_model_dir_untied)).generate(
        ["hello"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(completion.token_ids) == 5


def test_directory_without_config_is_refused_with_the_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        read_config(tmp_path)


def test_non_llama_architecture_is_refused_by_name(tmp_path, tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        read_config(tmp_path)


def test_directory_without_weights_is_refused(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load(tmp_path)


def _copy_with(tmp_path, source, change_tensors=None, change_config=None):
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path / "model"
    shutil.copytree(source, target)
    if change_tensors is not None:
        tensors = load_file(str(target / "model.safetensors"))
        change_tensors(tensors)
        save_file(tensors, str(target / "model.safetensors"))
    if change_config is not None:
        config = json.loads((target / "config.json").read_text())
        config.update(change_config)
        (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_missing_tensor_is_refused_naming_it_and_its_shape(tmp_path, tiny_model_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    target = _copy_with(tmp_path, tiny_model_dir, lambda t: t.pop(name))
    with pytest.raises(UnsupportedModelError, match=rf"lacks tensors .*{name} \(128, 64\)"):
        load(target)


def test_a_tensor_of_the_wrong_shape_is_refused_naming_both_shapes(tmp_path, tiny_model_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    target = _copy_with(tmp_path, tiny_model_dir, lambda t: t.update({name: t[name][:16].clone()}))
    shapes = r"has shape \(16, 64\); config.json implies \(32, 64\)"
    with pytest.raises(UnsupportedModelError, match=rf"{name} {shapes}"):
        load(target)


def test_a_family_needs_its_own_tensors(tmp_path, tiny_model_dir):
    """A Llama checkpoint relabelled Qwen3 lacks the q/k head norms: refused by name, not run without them."""
    target = _copy_with(tmp_path, tiny_model_dir, change_config={"model_type": "qwen3",
                                                                 "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(UnsupportedModelError, match=r"self_attn.q_norm.weight \(16,\)"):
        load(target)
