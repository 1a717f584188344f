"""prompt_logprobs (vLLM's): each prompt token scored by the logits of the position before it.

The values must be the very bits the same tokens get when generated (batch invariance makes a
prefill row and a decode row the same computation), whoever shares the steps, however the
prompt is chunked, and with no readback beyond the step's one.
"""

import pytest
import torch

from nanoserve.engine.output import ReadbackCounter
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

TOP = 3


def scored(entries) -> list[tuple]:
    return [(e.token_id, e.logprob, e.top) for e in entries]


def score(llm: LLM, prompt_ids: list[int], top: int = TOP):
    """The prompt's logprobs, generating one token."""
    return llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top))[0]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu")


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}])
def test_prompt_logprobs_equal_the_logprobs_the_same_tokens_got_when_generated(tiny, sampling):
    """Score prompt + generated tokens: the generated part's prompt logprobs are the generated
    logprobs, top alternatives included, compared with ==."""
    run = tiny.generate(["once upon a time"], SamplingParams(max_tokens=12, logprobs=TOP, ignore_eos=True,
                                                             **sampling))[0]
    whole = run.prompt_token_ids + run.token_ids
    entries = score(tiny, whole).prompt_logprobs
    assert scored(entries[len(run.prompt_token_ids):]) == scored(run.logprobs)


def test_the_first_position_has_none_and_every_other_scores_its_own_token(tiny):
    prompt = tiny.tokenizer.encode("the cat sat on the mat")
    entries = score(tiny, prompt).prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    assert all(len(e.top) == TOP for e in entries[1:])


def test_a_prompt_token_has_its_logprob_and_rank_in_the_models_distribution(tiny):
    """Against the model's last-position logits of each prefix, computed alone."""
    prompt = tiny.tokenizer.encode("a quick brown fox jumps")
    entries = score(tiny, prompt).prompt_logprobs
    logits = tiny.prompt_logits([prompt[:p] for p in range(1, len(prompt))])
    for p, row in enumerate(torch.log_softmax(logits, dim=-1), start=1):
        token = prompt[p]
        assert entries[p].logprob == pytest.approx(row[token].item(), abs=1e-5)
        assert entries[p].rank == int((row >= row[token]).sum())
        assert [t for t, _ in entries[p].top] == row.topk(TOP).indices.tolist()


def test_prompt_logprobs_are_the_same_alone_chunked_and_in_a_crowd(tiny_model_dir):
    """A long prompt prefilled in 5-token chunks, arriving while others decode and prefill."""
    prompts = [tiny_prompt(i) for i in range(6)]
    alone_llm = LLM(str(tiny_model_dir), device="cpu")
    alone = [scored(score(alone_llm, p).prompt_logprobs[1:]) for p in prompts]
    crowd = LLM(str(tiny_model_dir), device="cpu", max_num_batched_tokens=5)
    engine, ids, got = crowd.engine, {}, {}

    def step() -> None:
        for output in engine.step():
            if output.prompt_logprobs is not None:
                got[ids[output.request_id]] = scored(output.prompt_logprobs[1:])

    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=TOP if i % 2 else None, logprobs=1 if i % 3 else None)
        ids[engine.add_request(prompt, params)] = i
        step()
    while engine.has_unfinished():
        step()
    assert sorted(got) == [1, 3, 5]
    for i in range(1, 6, 2):
        assert got[i] == alone[i], f"prompt {i}"


def test_preemption_changes_no_prompt_logprob(tiny_model_dir):
    prompts = [tiny_prompt(i) for i in range(6)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)] * 6
    roomy = LLM(str(tiny_model_dir), device="cpu")
    cramped = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=16, block_size=4, max_num_batched_tokens=8)
    expected = [scored(c.prompt_logprobs[1:]) for c in roomy.generate(prompts, params)]
    got = [scored(c.prompt_logprobs[1:]) for c in cramped.generate(prompts, params)]
    assert cramped.engine.scheduler.num_preemptions >= 2, "the pool was not small enough to preempt"
    assert got == expected
    assert cramped.engine.pool.is_completely_free


def test_a_request_whose_prompt_is_scored_takes_no_prefix_cache_hit(tiny):
    """Cached positions have K/V but no logits: a scoring request prefills its whole prompt
    (as vLLM V1), and gets the values it gets with an empty cache."""
    prompt = tiny_prompt(9)
    first = score(tiny, prompt)
    warm = tiny.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    request_id = tiny.engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                                prompt_logprobs=TOP))
    outputs = []
    while tiny.engine.has_unfinished():
        outputs += [o for o in tiny.engine.step() if o.request_id == request_id]
    assert warm.token_ids == first.token_ids
    assert outputs[0].num_cached_tokens == 0
    assert scored(outputs[0].prompt_logprobs[1:]) == scored(first.prompt_logprobs[1:])
    unscored = tiny.engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    hits = [o.num_cached_tokens for o in tiny.engine.step() if o.request_id == unscored]
    assert hits[0] > 0, "the cache was not warm: the test proves nothing"


def test_scoring_a_prompt_reads_back_once_per_step(tiny_model_dir, monkeypatch):
    """A second transfer in one step raises; chunked prefills that sample nothing still
    bring their scores back in that step's one transfer."""
    llm = LLM(str(tiny_model_dir), device="cpu", max_num_batched_tokens=4)
    engine = llm.engine
    reads = {"step": 0}
    original_read, original_step = ReadbackCounter.read, engine.step

    def read_once(self, tensor):
        reads["step"] += 1
        if reads["step"] > 1:
            raise AssertionError("a second readback in one step")
        return original_read(self, tensor)

    def step():
        reads["step"] = 0
        return original_step()

    monkeypatch.setattr(ReadbackCounter, "read", read_once)
    monkeypatch.setattr(engine, "step", step)
    prompt = tiny_prompt(5)
    entries = score(llm, prompt).prompt_logprobs
    assert engine.readbacks.count == engine.stats.steps  # every chunk of the prompt read back once
    assert len(entries) == len(prompt) and entries[-1] is not None


def test_n_choices_share_one_scoring_of_their_prompt(tiny):
    out = tiny.generate(["hello there"], SamplingParams(n=3, max_tokens=2, seed=1, prompt_logprobs=0))[0]
    entries = out.prompt_logprobs
    assert len(out.outputs) == 3 and entries[0] is None and all(e.top == () for e in entries[1:])


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_are_refused_by_name(value):
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(prompt_logprobs=value)
    assert raised.value.param == "prompt_logprobs"


def tiny_prompt(i: int) -> list[int]:
    return [(7 * i + 3 * k) % 200 + 10 for k in range(9 + 4 * i)]


@pytest.mark.real_model
def test_on_the_default_model_prompt_logprobs_equal_the_generated_logprobs(default_llm):
    llm = default_llm
    run = llm.generate(["The three primary colours are"],
                       SamplingParams(max_tokens=8, temperature=0.0, logprobs=TOP))[0]
    entries = score(llm, run.prompt_token_ids + run.token_ids).prompt_logprobs
    assert scored(entries[len(run.prompt_token_ids):]) == scored(run.logprobs)
