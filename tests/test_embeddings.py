"""Embedding requests through the engine: pooled vectors against transformers' hidden states,
the same bits alone and in a crowd of generating requests, prefill only, one readback a step."""

from __future__ import annotations

import json

import pytest
import torch
from families import randomize, require_transformers
from test_engine import readbacks_raise_outside_the_output_processor

from nanoserve.errors import InvalidRequestError, UnsupportedModelError
from nanoserve.llm import LLM
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

PROMPTS = ["hello there friend, this prompt is long enough to be cut in chunks", "a b c", "x"]
RAW = {method: PoolingParams(method=method, normalize=False) for method in ("last", "mean")}


@pytest.fixture(scope="module")
def chunked(tiny_model_dir) -> LLM:
    """Steps of 8 tokens: the long prompt pools across several chunks; float32 K/V, transformers'
    own arithmetic (the default float16 cache's agreement is test_reference_parity's)."""
    return LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8,
               kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def hidden_states(tiny_model_dir):
    """transformers' float32 `last_hidden_state` of a prompt's token ids."""
    model = require_transformers().AutoModel.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def states(prompt_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt_ids])).last_hidden_state[0]

    return states


@pytest.mark.parametrize("method", ["last", "mean"])
def test_pooled_vectors_equal_transformers_hidden_states(chunked, hidden_states, method):
    for result in chunked.embed(PROMPTS, RAW[method]):
        states = hidden_states(result.prompt_token_ids)
        expected = states[-1] if method == "last" else states.mean(dim=0)
        torch.testing.assert_close(torch.tensor(result.embedding), expected, rtol=0, atol=1e-4)
    assert chunked.engine.pool.is_completely_free


def test_vectors_are_normalized_by_default(chunked, hidden_states):
    [result] = chunked.embed(PROMPTS[0])
    expected = torch.nn.functional.normalize(hidden_states(result.prompt_token_ids)[-1], dim=0)
    torch.testing.assert_close(torch.tensor(result.outputs.embedding), expected, rtol=0, atol=1e-4)
    assert torch.tensor(result.embedding).norm().item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("method", ["last", "mean"])
def test_a_vector_in_a_crowd_of_generating_requests_equals_its_solo_run_bit_for_bit(tiny_model_dir, method):
    """Alone the long prompt prefills in steps of 8; in the crowd its chunks are cut by the
    prefill budget beside decodes, and its rows share steps with sampled rows and other embeddings."""
    solo = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8,
               enable_prefix_caching=False)
    alone = [solo.embed(prompt, RAW[method])[0].embedding for prompt in PROMPTS]
    crowd = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                max_prefill_tokens_while_decoding=3, enable_prefix_caching=False)
    engine = crowd.engine
    for i in range(3):
        engine.add_request(f"generate {i}", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()  # they decode from now on
    ids = [engine.add_request(prompt, pooling=RAW[method]) for prompt in PROMPTS]
    vectors = {}
    while engine.has_unfinished():
        vectors.update((out.request_id, out.embedding) for out in engine.step() if out.embedding is not None)
    assert [vectors[i] for i in ids] == alone
    assert engine.pool.is_completely_free


def test_an_embedding_request_samples_nothing_and_reads_back_once_a_step(chunked):
    engine = chunked.engine
    engine.add_request("a neighbour", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    embedding_id = engine.add_request(PROMPTS[0], pooling=PoolingParams(method="mean"))
    steps = []
    while engine.has_unfinished():
        with readbacks_raise_outside_the_output_processor() as reads:
            outputs = engine.step()
        steps.append((len(reads), outputs))
    assert all(reads == (1 if outputs else 0) for reads, outputs in steps)
    [embedded] = [out for _, outputs in steps for out in outputs if out.request_id == embedding_id]
    assert embedded.finished and embedded.token_ids == [] and embedded.num_output_tokens == 0
    assert engine.pool.is_completely_free


def test_last_pooling_takes_the_cached_prefix_and_mean_pooling_computes_every_position(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, block_size=4)
    engine = llm.engine
    for method in ("last", "mean"):
        first = llm.embed(PROMPTS[0], RAW[method])[0].embedding
        engine.add_request(PROMPTS[0], pooling=RAW[method])
        [output] = [out for _ in iter(engine.has_unfinished, False) for out in engine.step()]
        assert (output.num_cached_tokens > 0) == (method == "last")
        assert output.embedding == first
    assert engine.pool.is_completely_free


def test_deferred_output_pools_the_same_vectors(tiny_model_dir, chunked):
    deferred = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, block_size=4,
                   max_num_batched_tokens=8, async_scheduling=True, kv_cache_dtype="float32")
    for method in ("last", "mean"):
        expected = [r.embedding for r in chunked.embed(PROMPTS, RAW[method])]
        assert [r.embedding for r in deferred.embed(PROMPTS, RAW[method])] == expected
    assert deferred.engine.pool.is_completely_free


def test_bad_pooling_requests_are_refused_naming_the_field(chunked, tiny_model_dir):
    hidden = chunked.engine.model_config.hidden_size
    with pytest.raises(InvalidRequestError) as refused:
        chunked.embed("x", PoolingParams(dimensions=hidden - 1))
    assert refused.value.param == "dimensions"
    assert len(chunked.embed("x", PoolingParams(dimensions=hidden))[0].embedding) == hidden
    for field, value in (("method", "cls"), ("normalize", 1), ("dimensions", 0)):
        with pytest.raises(InvalidRequestError) as refused:
            PoolingParams(**{field: value})
        assert refused.value.param == ("pooling" if field == "method" else field)
    assert not chunked.engine.has_unfinished()


def test_the_embed_task_pools_and_refuses_to_generate(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=32, task="embed", pooling="mean")
    assert llm.engine.pooling_method == "mean"
    assert len(llm.embed("hello")[0].embedding) == llm.engine.model_config.hidden_size
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate("hello")
    assert refused.value.param == "task"
    with pytest.raises(InvalidRequestError) as refused:
        LLM(str(tiny_model_dir), task="classify")
    assert refused.value.param == "task"


def _with_pooling_config(source, target, modes: dict[str, bool]):
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).symlink_to(path)
    (target / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return target


def test_the_checkpoints_own_pooling_is_the_default_and_an_unknown_one_is_refused(tiny_model_dir, tmp_path):
    mean = _with_pooling_config(tiny_model_dir, tmp_path / "mean",
                                {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    assert LLM(str(mean), device="cpu", num_kv_blocks=8, task="embed").engine.pooling_method == "mean"
    assert LLM(str(mean), device="cpu", num_kv_blocks=8, pooling="last").engine.pooling_method == "last"
    cls = _with_pooling_config(tiny_model_dir, tmp_path / "cls", {"pooling_mode_cls_token": True})
    with pytest.raises(UnsupportedModelError, match="pooling_mode_cls_token"):
        LLM(str(cls), device="cpu", num_kv_blocks=8, task="embed")


def test_a_headless_qwen3_checkpoint_loads_with_the_embed_task_and_pools_as_transformers(
        tiny_model_dir, tmp_path):
    """A Qwen3-Embedding-shaped checkpoint: saved from transformers' `Qwen3Model` (architectures
    ["Qwen3Model"], no head, tensors without the `model.` prefix), with its pooling config."""
    transformers = require_transformers()
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed=3, gemma=False)
    path = _with_pooling_config(tiny_model_dir, tmp_path / "embedder", {"pooling_mode_lasttoken": True})
    for name in ("config.json", "model.safetensors"):
        (path / name).unlink()
    model.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    with pytest.raises(InvalidRequestError) as refused:
        LLM(str(path), device="cpu", num_kv_blocks=8)
    assert refused.value.param == "task"
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, task="embed",
              kv_cache_dtype="float32")
    for result in llm.embed(PROMPTS, PoolingParams(normalize=False)):
        with torch.no_grad():
            expected = model(torch.tensor([result.prompt_token_ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(result.embedding), expected, rtol=0, atol=1e-4)


def test_a_vector_after_preemption_equals_its_solo_run_bit_for_bit(tiny_model_dir):
    """A pool of 16 blocks of 4 tokens: the decoders grow until the newest request, the
    embedding midway through its chunked prefill, is preempted and later recomputed."""
    alone = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    expected = alone.embed(PROMPTS[0], RAW["mean"])[0].embedding
    tight = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=16, block_size=4, max_num_batched_tokens=8,
                max_prefill_tokens_while_decoding=4, enable_prefix_caching=False)
    engine = tight.engine
    for i in range(2):
        engine.add_request(f"grow {i}", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    engine.step()
    request_id = engine.add_request(PROMPTS[0], pooling=RAW["mean"])
    request = engine.requests[request_id]
    vectors = {}
    while engine.has_unfinished():
        vectors.update((out.request_id, out.embedding) for out in engine.step() if out.embedding is not None)
    assert request.num_preemptions > 0
    assert vectors[request_id] == expected
    assert engine.pool.is_completely_free
