"""Speculation from a draft model changes no bit: outputs with it equal outputs without it, `==`.

The target is the untied tiny model (its greedy text varies, so drafts have something to get
right). A draft identical to it proposes exactly its greedy tokens (accepted == drafted); the
tied tiny model, another random model over the same vocabulary, mostly disagrees. Either way,
alone and in staggered crowds with preemption, the tokens, logprobs and text are the ones the
target gives without speculation. Bad settings are refused naming the field or option.
"""

from __future__ import annotations

import pytest
from click.testing import Result
from hypothesis import HealthCheck, given, settings
from test_engine import readbacks_raise_outside_the_output_processor
from test_spec_decode import (
    BLOCK_SIZE,
    MODES,
    NUM_BLOCKS,
    assert_engines_agree,
    run_staggered,
    workloads,
)
from tiny_model import write_tiny_llama
from typer.testing import CliRunner

from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

COMMON = {"device": "cpu", "block_size": BLOCK_SIZE, "num_kv_blocks": NUM_BLOCKS, "max_num_seqs": 6}
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, logprobs=2, ignore_eos=True)


def drafting(target, draft, **options) -> LLM:
    return LLM(str(target), speculative_tokens=4, speculative_method="draft", draft_model=str(draft),
               **COMMON, **options)


@pytest.fixture(scope="module")
def engines(tiny_model_dir_untied, tiny_model_dir):
    """(no speculation, a draft identical to the target, a draft that mostly disagrees)."""
    target = tiny_model_dir_untied
    return (LLM(str(target), **COMMON), drafting(target, target), drafting(target, tiny_model_dir))


def crowd_jobs(params_for):
    prompts = [[3 + i, 9, 4 + 2 * i, 17] * (1 + i % 3) for i in range(6)]
    return [(prompt, params_for(i), None) for i, prompt in enumerate(prompts)]


def draft_counts(llm: LLM) -> tuple[int, int]:
    return llm.engine.stats.spec_draft_tokens, llm.engine.stats.spec_accepted_tokens


def test_a_draft_identical_to_the_target_always_agrees_with_greedy_rows(engines):
    plain, same, _ = engines
    jobs = crowd_jobs(lambda i: GREEDY)
    expected, _ = run_staggered(plain, jobs)
    before = draft_counts(same)
    got, _ = run_staggered(same, jobs)
    assert got == expected
    drafted, accepted = (now - then for now, then in zip(draft_counts(same), before, strict=True))
    assert drafted > 0 and accepted == drafted
    assert same.engine.draft.pool.is_completely_free


def test_a_different_draft_mostly_disagrees_and_changes_no_token_logprob_or_text(engines):
    plain, _, other = engines
    jobs = crowd_jobs(lambda i: SamplingParams(max_tokens=14, seed=i, logprobs=2, ignore_eos=True,
                                               **MODES[i % len(MODES)]))
    expected, _ = run_staggered(plain, jobs)
    before = draft_counts(other)
    got, _ = run_staggered(other, jobs)
    assert got == expected
    drafted, accepted = (now - then for now, then in zip(draft_counts(other), before, strict=True))
    assert drafted > 0 and accepted < drafted / 2
    assert other.engine.draft.pool.is_completely_free and other.engine.pool.is_completely_free


def test_drafted_outputs_alone_equal_drafted_outputs_in_a_crowd_that_preempts(engines):
    plain, same, other = engines
    # 44-token prompts, 16 blocks each at the end: four alive at once outgrow the 40-block pool.
    long = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True)
    jobs = [([5 + i, 6, 7, 8] * 11, long, None) for i in range(6)]
    preemptions = other.engine.scheduler.num_preemptions
    crowd, _ = run_staggered(other, jobs)
    assert other.engine.scheduler.num_preemptions > preemptions, "the crowd never preempted"
    for i, job in enumerate(jobs):
        alone, _ = run_staggered(same, [job])
        assert alone[0] == crowd[i] == run_staggered(plain, [job])[0][0]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(jobs=workloads())
def test_random_workloads_give_the_same_outputs_with_a_draft_model(engines, jobs):
    plain, same, other = engines
    assert_engines_agree(plain, (same, other), jobs)


def test_a_draft_model_with_another_vocabulary_is_refused_naming_the_field(tiny_model_dir, tmp_path):
    wide = write_tiny_llama(tmp_path / "wide", vocab_size=512)
    with pytest.raises(ValueError, match="vocabulary") as caught:
        drafting(tiny_model_dir, wide)
    assert isinstance(caught.value, InvalidRequestError) and caught.value.param == "draft_model"


def test_a_draft_model_without_the_draft_method_is_refused_naming_the_field(tiny_model_dir):
    with pytest.raises(InvalidRequestError) as caught:
        LLM(str(tiny_model_dir), speculative_tokens=4, draft_model=str(tiny_model_dir), **COMMON)
    assert caught.value.param == "draft_model"


def generate(*args: str) -> Result:
    from nanoserve_cli.main import app

    return CliRunner().invoke(app, ["generate", "hello", "--max-tokens", "2", "--device", "cpu", *args])


def test_the_cli_refuses_the_draft_method_without_a_draft_model_or_with_another_vocabulary(
        tiny_model_dir, tmp_path):
    common = ["--model", str(tiny_model_dir), "--speculative-tokens", "2", "--speculative-method", "draft"]
    missing = generate(*common)
    assert missing.exit_code == 2 and "--draft-model" in missing.output
    wide = write_tiny_llama(tmp_path / "wide", vocab_size=512)
    other_vocab = generate(*common, "--draft-model", str(wide))
    assert other_vocab.exit_code == 2
    assert "--draft-model" in other_vocab.output and "vocabulary" in other_vocab.output


def test_a_drafting_step_reads_back_once_drafts_and_verification_together(engines):
    """The draft model's K picks stay on the device: the verification's input rows are filled
    from them there, and they come back in the step's one readback with the sampled tokens."""
    _, same, _ = engines
    engine = same.engine
    # No logprobs: the drafts ride with the token ids alone (the other tests pack logprobs too).
    engine.add_request([3, 9, 4, 17] * 2, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    engine.add_request([5, 9, 6, 17], SamplingParams(max_tokens=10, seed=4, temperature=0.9, top_p=0.9,
                                                     ignore_eos=True))
    reads_per_step, drafted = [], engine.stats.spec_draft_tokens
    while engine.has_unfinished():
        with readbacks_raise_outside_the_output_processor() as reads:
            engine.step()
        reads_per_step.append(len(reads))
    assert engine.stats.spec_draft_tokens > drafted, "no step drafted"
    assert reads_per_step and set(reads_per_step) == {1}
    assert engine.draft.pool.is_completely_free and engine.pool.is_completely_free
