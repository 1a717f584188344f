"""The default model against golden outputs of an independent implementation (float32).

Tokenization and the chat template are pinned in test_tokenizer.py; here: last-position
logits within 1e-3 of the reference, and greedy decoding token for token, EOS included.
"""

import pytest
import torch

from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", device="cpu")


def test_last_position_logits_match_the_reference_within_1e_3(llm, reference):
    prompts = [case["prompt_ids"] for case in reference.cases]
    logits = llm.prompt_logits(prompts)
    for i in range(len(prompts)):
        expected = reference.logits[f"last_logits_{i}"]
        assert (logits[i] - expected).abs().max().item() < 1e-3, f"case {i}"


def test_greedy_decoding_reproduces_the_reference_token_for_token(llm, reference):
    prompts = [case["prompt_ids"] for case in reference.cases]
    completions = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    for case, completion in zip(reference.cases, completions, strict=True):
        assert completion.token_ids == case["greedy_ids"], case["prompt"] or case["rendered"]
        expected_finish = "stop" if case["greedy_ids"][-1] in llm.tokenizer.eos_token_ids else "length"
        assert completion.finish_reason == expected_finish


def test_bfloat16_stays_close_to_the_float32_reference(default_model_dir, reference):
    """bfloat16 weights lose precision; the top token should survive on these prompts."""
    llm = LLM(str(default_model_dir), dtype="bfloat16", device="cpu")
    logits = llm.prompt_logits([case["prompt_ids"] for case in reference.cases])
    for i, row in enumerate(logits):
        assert row.argmax().item() == reference.logits[f"last_logits_{i}"].argmax().item()
        assert torch.isfinite(row).all()
