"""Every family against transformers: tiny random checkpoints built by each family's own
transformers config class (tests/families.py), loaded by nanoserve from the saved directory.

Properties, per checkpoint: last-position logits within 1e-4 of transformers' float32 forward
(native and torch small ops, batch-invariant and plain attention); greedy tokens equal over 32
steps; a prefill in chunks bit-identical to one prefill; a request's logits bit-identical alone
and in a crowd (the batch-invariant default). The sizes catch wrong assumptions: head_dim not
hidden / heads, one K/V head, K/V heads = heads, odd vocabularies, sliding windows shorter
than the prompts.
"""

import families
import pytest
import torch
from families import Case, crowd_logits, greedy, load_model, prefill_logits, reference_greedy

from nanoserve.native import ops as native_ops

families.require_transformers()

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.1 * i for i in range(8)], "original_max_position_embeddings": 64}
CASES = [
    Case("llama-biases-gelu-tied", "LlamaConfig",
         {"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu", "tie_word_embeddings": True}),
    Case("llama-gelu-tanh-head-dim-24-one-kv-head", "LlamaConfig",
         {"hidden_act": "gelu_pytorch_tanh", "head_dim": 24, "num_key_value_heads": 1, "vocab_size": 199}),
    Case("llama-rope-linear-kv-eq-heads", "LlamaConfig",
         {"num_key_value_heads": 4, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                         "rope_theta": 100000.0}}),
    Case("llama-rope-yarn", "LlamaConfig",
         {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 32}}),
    Case("llama-rope-dynamic", "LlamaConfig",
         {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    Case("llama-rope-llama3", "LlamaConfig",
         {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                              "rope_theta": 500000.0}}),
    Case("qwen2", "Qwen2Config", {"vocab_size": 257}, gguf="qwen2"),
    Case("qwen2-sliding-upper-layer", "Qwen2Config",
         {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    Case("qwen3-head-dim-32", "Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}, gguf="qwen3"),
    Case("mistral-window-5", "MistralConfig", {"sliding_window": 5, "head_dim": 16}),
    Case("phi3-longrope-window-6", "Phi3Config",
         {"max_position_embeddings": 256, "original_max_position_embeddings": 64, "sliding_window": 6,
          "rope_parameters": LONGROPE, "num_key_value_heads": 4}),
    # Phi-4-mini: RoPE on the first 3/4 of each head (12 of 16 dims), LongRoPE, a tied head.
    Case("phi4-mini-partial-rotary-longrope", "Phi3Config",
         {"max_position_embeddings": 256, "original_max_position_embeddings": 64, "tie_word_embeddings": True,
          "rope_parameters": {**LONGROPE, "partial_rotary_factor": 0.75,
                              "short_factor": LONGROPE["short_factor"][:6],
                              "long_factor": LONGROPE["long_factor"][:6]}}),
    Case("phi3-partial-rotary-half-head-dim-24", "Phi3Config",
         {"head_dim": 24, "partial_rotary_factor": 0.5, "num_key_value_heads": 1}),
    Case("gemma2-softcap-window-5", "Gemma2Config",
         {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 5, "tie_word_embeddings": True,
          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "num_key_value_heads": 1}),
    Case("gemma3-local-rope-window-6", "Gemma3TextConfig",
         {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6, "tie_word_embeddings": True,
          "layer_types": ["sliding_attention", "full_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1000000.0}}}),
]
PROMPTS = [[5, 17, 33, 8, 91, 4, 60], [3, *range(40, 52)], [7, 150, 9, *range(100, 118)]]
NATIVE = [pytest.param(True, id="native-ops"), pytest.param(False, id="torch-ops")]
if native_ops.load() is None:
    NATIVE[0] = pytest.param(True, id="native-ops", marks=pytest.mark.skip(reason="no native library here"))


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def checkpoint(request, tmp_path_factory):
    """(case, saved directory, transformers model, its last-position logits of PROMPTS)."""
    case = request.param
    path = tmp_path_factory.mktemp(case.name)
    model = families.write_checkpoint(case, path)
    return case, path, model, [families.reference_logits(model, p) for p in PROMPTS]


# The native attention is batch-invariant by construction in both modes, so "plain" differs
# from "invariant" only on the torch path (SDPA, or explicit products with soft-capping).
FORMS = [pytest.param(True, True, id="native-ops", marks=NATIVE[0].marks),
         pytest.param(False, True, id="torch-ops-invariant"),
         pytest.param(False, False, id="torch-ops-plain")]


@pytest.mark.parametrize(("native", "batch_invariant"), FORMS)
def test_last_position_logits_match_transformers(checkpoint, native, batch_invariant):
    _, path, _, expected = checkpoint
    model = load_model(path, batch_invariant=batch_invariant, native=native)
    for prompt, reference in zip(PROMPTS, expected, strict=True):
        torch.testing.assert_close(prefill_logits(model, prompt), reference, atol=1e-4, rtol=0)


def test_greedy_tokens_equal_transformers_over_32_steps(checkpoint):
    """The default forms (native where it runs); 32 steps carry every window past the prompt."""
    _, path, hf_model, _ = checkpoint
    prompt = PROMPTS[0]
    assert greedy(load_model(path), prompt, 32) == reference_greedy(hf_model, prompt, 32)


@pytest.mark.parametrize("native", NATIVE)
def test_a_prefill_in_chunks_is_bit_identical_to_one_prefill(checkpoint, native):
    model = load_model(checkpoint[1], native=native)
    prompt = PROMPTS[2]
    assert torch.equal(prefill_logits(model, prompt, chunk=5), prefill_logits(model, prompt))


@pytest.mark.parametrize("native", NATIVE)
def test_a_request_is_bit_identical_alone_and_in_a_crowd(checkpoint, native):
    model = load_model(checkpoint[1], native=native)
    for alone, crowded in zip(*(crowd_logits(model, PROMPTS, crowd) for crowd in (False, True)),
                              strict=True):
        assert torch.equal(alone, crowded)


# Long contexts, scaled down: the RoPE scalings' original contexts are 16 and 32 positions, so a
# 600-token prompt runs them 20-40x past it (YaRN, llama3), every window slides hundreds of
# positions, and the native attention cuts the context into three of its partitions
# (csrc/nanoserve.h's NS_ATTN_PARTITION, 256 slots). LongRoPE is not here: its context is capped
# at the original (README, "Model families").
LONG_CASES = ["llama-rope-yarn", "llama-rope-llama3", "mistral-window-5", "qwen2-sliding-upper-layer",
              "gemma2-softcap-window-5", "gemma3-local-rope-window-6"]
LONG_PROMPT_TOKENS = 600


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("name", LONG_CASES)
def test_a_prompt_across_attention_partitions_matches_transformers(name, native, tmp_path):
    """Last-position logits of a 600-token prompt against transformers (float32, 1e-4), in one
    prefill and in chunks that straddle the partitions (bit-identical to the one prefill)."""
    case = next(c for c in CASES if c.name == name)
    case = Case(case.name, case.config_class, {**case.fields, "max_position_embeddings": 1024})
    hf_model = families.write_checkpoint(case, tmp_path)
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, families.BASE["vocab_size"], (LONG_PROMPT_TOKENS,), generator=g).tolist()
    model = load_model(tmp_path, native=native)

    def prefill(chunk: int) -> torch.Tensor:
        cache = families.Cache(model.config, num_blocks=LONG_PROMPT_TOKENS // families.BLOCK + 1)
        for start in range(0, len(prompt), chunk):
            logits = families.step(model, cache, [("a", prompt[start:start + chunk], start)])["a"]
        return logits

    whole = prefill(LONG_PROMPT_TOKENS)
    torch.testing.assert_close(whole, families.reference_logits(hf_model, prompt), atol=1e-4, rtol=0)
    assert torch.equal(prefill(200), whole)


# llama.cpp keeps some of Gemma's settings in code, not in the file: the query scale is
# 1/sqrt(head_dim) and Gemma 3 slides five layers of six. Its GGUF cases say the same in HF terms.
FIELDS = {c.name: c.fields for c in CASES}
GGUF_CASES = [c for c in CASES if c.gguf] + [
    Case("phi3-gguf", "Phi3Config", FIELDS["phi3-longrope-window-6"], gguf="phi3"),
    Case("phi4-mini-gguf", "Phi3Config", FIELDS["phi4-mini-partial-rotary-longrope"], gguf="phi3"),
    Case("gemma2-gguf", "Gemma2Config", {**FIELDS["gemma2-softcap-window-5"], "query_pre_attn_scalar": 16},
         gguf="gemma2"),
    Case("gemma3-gguf", "Gemma3TextConfig",
         {**FIELDS["gemma3-local-rope-window-6"], "layer_types": ["sliding_attention", "sliding_attention"]},
         gguf="gemma3"),
]


@pytest.mark.parametrize("case", GGUF_CASES, ids=[c.name for c in GGUF_CASES])
def test_a_gguf_of_the_same_weights_matches_transformers(case, tmp_path):
    """Through the importer (metadata -> config.json, tensors renamed) and through the blocks
    path (`gguf=`), both against transformers."""
    from nanoserve.loading.gguf import convert_gguf

    hf_model = families.write_checkpoint(case, tmp_path / "hf")
    path = families.write_gguf(tmp_path / "hf", tmp_path / "model.gguf", case.gguf)
    imported = load_model(convert_gguf(path, tmp_path / "imported"))
    blocks = load_model(tmp_path / "imported", gguf=path)
    for prompt in PROMPTS[:2]:
        reference = families.reference_logits(hf_model, prompt)
        torch.testing.assert_close(prefill_logits(imported, prompt), reference, atol=1e-4, rtol=0)
        torch.testing.assert_close(prefill_logits(blocks, prompt), reference, atol=1e-4, rtol=0)


@pytest.mark.skipif(native_ops.load() is None, reason="no native library here")
def test_soft_capped_attention_runs_in_the_native_kernel_and_matches_the_torch_path(tmp_path):
    """The native attention soft-caps its scores: Gemma 2 attends natively (its sliding layers
    too), and its logits match the torch path's (and transformers': the tests above)."""
    case = next(c for c in CASES if c.config_class == "Gemma2Config")
    families.write_checkpoint(case, tmp_path)
    model = load_model(tmp_path)
    assert model.ops is not None and model.native_attention and model.config.attn_softcap
    plain = load_model(tmp_path, native=False)
    assert plain.ops is None
    torch.testing.assert_close(prefill_logits(model, PROMPTS[1]), prefill_logits(plain, PROMPTS[1]),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen3-head-dim-32", "gemma2-softcap-window-5"])
def test_the_engine_serves_a_family_end_to_end(name, tmp_path, tiny_model_dir):
    """Through LLM (the engine's own kernel choice, scheduler and sampler): greedy tokens of a
    family checkpoint equal transformers', alone and beside another request."""
    import shutil

    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    case = next(c for c in CASES if c.name == name)
    case = Case(case.name, case.config_class, {**case.fields, "vocab_size": 400})  # the tokenizer's 384 fit
    hf_model = families.write_checkpoint(case, tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / file, tmp_path / file)
    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=64, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt, other = PROMPTS[0], PROMPTS[2]
    results = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], params)
    alone = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    expected = reference_greedy(hf_model, prompt, 12)
    assert results[0].outputs[0].token_ids == alone.outputs[0].token_ids == expected
