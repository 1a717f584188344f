"""Long contexts against transformers: sliding windows and RoPE scaling at 16k positions, and
prefix caching and preemption at 32k, through the engine (LLM: scheduler, chunked prefill,
paged cache, sampler), on the path the process runs: native, or the torch one under
NANOSERVE_NO_NATIVE=1 (the suite's second run in .ci/run).

Per checkpoint (tiny, random, built by transformers' own config class; most pair a family's
window with a RoPE scaling, so six models cover every kind): the engine's logprobs of the last
prompt positions (prompt_logprobs) and of 8 greedy steps, all 20 it returns per position and
the chosen token's, within 1e-4 absolute (rtol 0, as tests/test_families.py holds logits) of
transformers' float32 log-softmax at the same token ids; and the greedy tokens equal.
Transformers' reference is its own chunked prefill through its own cache (its attention at 16k
in one piece would hold gigabytes of scores), SDPA except Gemma 2, whose soft-capping only
eager runs.

At 32k (a one-layer llama3-scaled model, full attention): a prompt served twice, and one
sharing its first 30k tokens, are bit-identical (tokens and logprobs) with prefix caching on
and off; two such requests in a pool too small for both (the second is preempted) are each
bit-identical to running alone.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import families
import pytest
import torch

from nanoserve import native
from nanoserve.llm import LLM
from nanoserve.native import ops as native_ops
from nanoserve.native import quant as native_quant
from nanoserve.sampling_params import SamplingParams

transformers = families.require_transformers()

PROMPT_LEN = 16384
LONG_PROMPT_LEN = 32000
SHARED_PREFIX_LEN = 30000
STEPS = 8
SCORED_PROMPT_POSITIONS = 4  # the last prompt tokens whose prompt_logprobs are compared
TOP = 20  # SamplingParams' most logprobs per position
CHUNK = 1024  # the engine's max_num_batched_tokens: a 16k prompt prefills in 16 chunks
BLOCK = 16
LONG = {"vocab_size": 400,  # the tiny tokenizer's 384 ids fit
        "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 32768}


def long_case(name: str, config_class: str, fields: dict) -> families.Case:
    return families.Case(name, config_class, {**LONG, **fields})


CASES = [
    long_case("llama-rope-llama3", "LlamaConfig",
              {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 2048,
                                   "rope_theta": 500000.0}}),
    long_case("qwen2-window-256-upper-layer-rope-yarn", "Qwen2Config",
              {"use_sliding_window": True, "sliding_window": 256, "max_window_layers": 1,
               "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 4096}}),
    long_case("mistral-window-512", "MistralConfig", {"sliding_window": 512}),
    # LongRoPE's short factors: nanoserve's context is capped at the original one (docs/models.md)
    long_case("phi3-window-384-longrope", "Phi3Config",
              {"max_position_embeddings": 131072, "original_max_position_embeddings": 32768,
               "sliding_window": 384,
               "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                   "short_factor": [1.0 + 0.25 * i for i in range(8)],
                                   "long_factor": [4.0 + 0.25 * i for i in range(8)],
                                   "original_max_position_embeddings": 32768}}),
    long_case("gemma2-softcap-window-128-rope-dynamic", "Gemma2Config",
              {"query_pre_attn_scalar": 16, "sliding_window": 128, "tie_word_embeddings": True,
               "attn_logit_softcapping": 20.0, "final_logit_softcapping": 30.0,
               "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}),
    long_case("gemma3-window-64-global-rope-linear", "Gemma3TextConfig",
              {"query_pre_attn_scalar": 16, "sliding_window": 64, "tie_word_embeddings": True,
               "layer_types": ["sliding_attention", "full_attention"],
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                      "rope_theta": 1000000.0}}}),
]
# The path this process runs: native here, torch under NANOSERVE_NO_NATIVE=1, so the suite's two
# runs (.ci/run) cover each path once at these lengths instead of the torch path twice.
PATHS = ["native" if native_ops.load() is not None else "torch"]


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, LONG["vocab_size"], (length,), generator=generator).tolist()


@contextlib.contextmanager
def kernels(path: str) -> Iterator[None]:
    """Engines started inside run `path`: "torch" is NANOSERVE_NO_NATIVE=1 (the library is
    loaded once per process, so its caches are cleared both ways); "native" is what the
    process runs (the torch path too where the suite runs under NANOSERVE_NO_NATIVE=1)."""
    if path == "native":
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(native.DISABLE_VARIABLE, "1")
        native._load.cache_clear()
        native_quant._lib.cache_clear()
        try:
            yield
        finally:
            patch.undo()
            native._load.cache_clear()
            native_quant._lib.cache_clear()


def write_long_checkpoint(case: families.Case, path, tiny_model_dir):
    model = families.write_checkpoint(case, path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / file, path / file)
    model.set_attn_implementation("eager" if case.config_class == "Gemma2Config" else "sdpa")
    return model


def reference_run(model, prompt: list[int]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Transformers' (log-softmax of the last SCORED_PROMPT_POSITIONS + 1 prompt positions'
    logits, greedy tokens, log-softmax of each greedy step's logits), float32, prefilled in
    CHUNK pieces through its own cache, then one token a step."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        for start in range(0, len(prompt), CHUNK):
            logits = model(torch.tensor([prompt[start:start + CHUNK]]), past_key_values=cache,
                           use_cache=True).logits[0]
        prompt_logprobs = torch.log_softmax(logits[-SCORED_PROMPT_POSITIONS - 1:].float(), dim=-1)
        tokens, step_logprobs = [], [prompt_logprobs[-1]]
        for _ in range(STEPS - 1):
            tokens.append(int(step_logprobs[-1].argmax()))
            logits = model(torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True).logits[0, -1]
            step_logprobs.append(torch.log_softmax(logits.float(), dim=-1))
        tokens.append(int(step_logprobs[-1].argmax()))
    return prompt_logprobs[:-1], tokens, torch.stack(step_logprobs)


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def checkpoint(request, tmp_path_factory, tiny_model_dir):
    """(saved directory, prompt, transformers' reference_run of it)."""
    case = request.param
    path = tmp_path_factory.mktemp(case.name)
    model = write_long_checkpoint(case, path, tiny_model_dir)
    prompt = random_prompt(PROMPT_LEN, seed=1)
    return path, prompt, reference_run(model, prompt)


def make_llm(path, **overrides):
    # No prefill pace: every prefill step runs CHUNK tokens, whatever this machine's speed, and
    # as many beside a decode (so a prompt admitted beside another's decode outgrows the pool).
    # float32 K/V: transformers' own arithmetic (the default float16 cache's agreement is
    # test_reference_parity's).
    settings = {"device": "cpu", "block_size": BLOCK, "kv_cache_dtype": "float32", "max_num_seqs": 4,
                "max_num_batched_tokens": CHUNK,
                "max_prefill_tokens_while_decoding": CHUNK, "prefill_step_ms": float("inf"),
                "num_kv_blocks": 32768 // BLOCK + 8} | overrides
    return LLM(str(path), **settings)


def assert_logprobs_close(entries, reference: torch.Tensor, what: str) -> None:
    """Every (token id, logprob) an entry returns, within 1e-4 of the reference row's."""
    for i, (entry, row) in enumerate(zip(entries, reference, strict=True)):
        ids = torch.tensor([token for token, _ in entry.top] + [entry.token_id])
        got = torch.tensor([logprob for _, logprob in entry.top] + [entry.logprob])
        error = float((got - row[ids]).abs().max())
        assert error <= 1e-4, f"{what} {i}: logprobs off by {error:.2e}"


@pytest.mark.parametrize("path", PATHS)
def test_late_positions_and_greedy_tokens_match_transformers(checkpoint, path):
    model_dir, prompt, (prompt_reference, tokens_reference, steps_reference) = checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=TOP,
                            prompt_logprobs=TOP)
    with kernels(path):
        result = make_llm(model_dir).generate([{"prompt_token_ids": prompt}], params)[0]
    assert_logprobs_close(result.prompt_logprobs[-SCORED_PROMPT_POSITIONS:], prompt_reference,
                          f"prompt position {PROMPT_LEN - SCORED_PROMPT_POSITIONS} +")
    assert_logprobs_close(result.logprobs, steps_reference, "greedy step")
    assert result.token_ids == tokens_reference


# llama3-scaled full attention, each query reading every key before it; one layer, as the
# properties below are the cache's and the scheduler's, and each 32k prefill costs its square.
LONG_CASE = families.Case("llama-one-layer-rope-llama3", "LlamaConfig",
                          {**CASES[0].fields, "num_hidden_layers": 1})


def fingerprint(result) -> tuple[list[int], list]:
    return result.token_ids, result.logprobs


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory, tiny_model_dir):
    """(saved directory, prompt a of 32k tokens, prompt b sharing a's first 30k)."""
    path = tmp_path_factory.mktemp("long")
    write_long_checkpoint(LONG_CASE, path, tiny_model_dir)
    a = random_prompt(LONG_PROMPT_LEN, seed=2)
    b = a[:SHARED_PREFIX_LEN] + random_prompt(LONG_PROMPT_LEN - SHARED_PREFIX_LEN, seed=3)
    return path, a, b


def long_params():
    return SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", params=PATHS)
def alone(request, long_checkpoint):
    """(path, each long prompt's fingerprint run alone with prefix caching off)."""
    model_dir, a, b = long_checkpoint
    with kernels(request.param):
        llm = make_llm(model_dir, enable_prefix_caching=False)
        runs = [fingerprint(llm.generate([{"prompt_token_ids": p}], long_params())[0]) for p in (a, b)]
    assert llm.engine.pool.is_completely_free
    return request.param, runs


def test_prefix_caching_at_32k_changes_no_token_or_logprob(long_checkpoint, alone):
    """a twice (the second finds all of a's full blocks cached), then b (its 30k prefix cached)."""
    model_dir, a, b = long_checkpoint
    path, (a_alone, b_alone) = alone
    with kernels(path):
        llm = make_llm(model_dir, enable_prefix_caching=True)
        runs = [fingerprint(llm.generate([{"prompt_token_ids": p}], long_params())[0]) for p in (a, a, b)]
    assert runs == [a_alone, a_alone, b_alone]
    cached_a, cached_b = (LONG_PROMPT_LEN - 1) // BLOCK * BLOCK, SHARED_PREFIX_LEN // BLOCK * BLOCK
    assert llm.engine.scheduler.prefix_cache_hits == cached_a + cached_b
    assert llm.engine.pool.is_completely_free


def test_preemption_at_32k_changes_no_token_or_logprob(long_checkpoint, alone):
    """A pool with room for one request's 32k and 100 blocks more: b is admitted beside a's last
    prefill chunk and preempted as its own chunks outgrow what a's decode leaves."""
    model_dir, a, b = long_checkpoint
    path, runs_alone = alone
    one_request = -(-(LONG_PROMPT_LEN + STEPS) // BLOCK)
    with kernels(path):
        llm = make_llm(model_dir, enable_prefix_caching=False, num_kv_blocks=one_request + 100)
        results = llm.generate([{"prompt_token_ids": p} for p in (a, b)], long_params())
    assert [fingerprint(r) for r in results] == runs_alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.is_completely_free
