"""The engine end to end: stop rules, streaming, readbacks, invariance in a crowd, preemption."""

import contextlib

import pytest
import torch

from nanoserve.engine.core import PHASES
from nanoserve.engine.output import ReadbackCounter
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", batch_invariant=True)


@pytest.fixture(scope="module")
def real(default_llm):
    return default_llm  # float32, batch-invariant


def solo(llm, prompt, params):
    return llm.generate([prompt], params)[0]


def test_max_tokens_ends_with_length_and_frees_every_block(tiny):
    completion = solo(tiny, "hello world", GREEDY)
    assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
    assert tiny.engine.pool.is_completely_free


def test_stop_token_id_ends_the_request_without_its_text(tiny):
    first = solo(tiny, "hello world", GREEDY).token_ids
    stop_id = first[3]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,))
    completion = solo(tiny, "hello world", params)
    cut = first.index(stop_id)
    assert completion.token_ids == first[: cut + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.text == tiny.tokenizer.decode(first[:cut])


def test_stop_string_is_not_emitted_and_text_before_it_is(tiny):
    full = solo(tiny, "the quick brown", GREEDY).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip(f"the tiny model's text {full!r} has no printable stop string there")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    completion = solo(tiny, "the quick brown", params)
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full[: full.index(stop)]


@pytest.mark.real_model
def test_streamed_text_equals_collected_text_and_has_no_broken_characters(real):
    prompt = "Ünïcödé and emoji 🚀 test:"
    params = SamplingParams(max_tokens=24, temperature=0.0)
    deltas = [out.text for out in real.stream(prompt, params)]
    assert "".join(deltas) == solo(real, prompt, params).text
    assert all("\ufffd" not in delta for delta in deltas)


def test_abandoned_stream_aborts_and_frees_its_blocks(tiny):
    stream = tiny.stream("hello", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(stream)
    stream.close()
    assert not tiny.engine.has_unfinished() and tiny.engine.pool.is_completely_free


# Every way a tensor's values reach Python: each one waits for the device.
READBACKS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")


@contextlib.contextmanager
def readbacks_raise_outside_the_output_processor():
    """Make every readback raise, except the output processor's own (`ReadbackCounter.read`).

    Yields the list of sanctioned readbacks made so far, one entry each.
    """
    sanctioned: list[int] = []
    inside = False

    def forbidden(name, original):
        def guarded(self, *args, **kwargs):
            if not inside:
                raise AssertionError(f"Tensor.{name} read back outside the output processor's readback")
            return original(self, *args, **kwargs)
        return guarded

    def read(counter, tensor):
        nonlocal inside
        sanctioned.append(1)
        inside = True
        try:
            return real_read(counter, tensor)
        finally:
            inside = False

    real_read = ReadbackCounter.read
    with pytest.MonkeyPatch.context() as patch:
        for name in READBACKS:
            patch.setattr(torch.Tensor, name, forbidden(name, getattr(torch.Tensor, name)))
        patch.setattr(ReadbackCounter, "read", read)
        yield sanctioned


def test_a_whole_step_reads_back_once_and_only_in_the_output_processor(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", max_num_batched_tokens=12, num_kv_blocks=64, block_size=4)
    engine = llm.engine
    params = [
        GREEDY,
        SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.2, top_k=5, min_p=0.05, seed=2, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.5, logit_bias=((3, 2.0),), ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, min_tokens=3, stop=["e"]),
    ]
    prompts = ["hello there friend " * 4, "a b c", "x", "the quick brown fox"]  # the first is chunked
    steps = []  # (sanctioned readbacks, outputs, whether the step was decodes only)

    def guarded_step():
        decode_steps = engine.stats.decode_steps
        with readbacks_raise_outside_the_output_processor() as reads:
            outputs = engine.step()
        steps.append((len(reads), len(outputs), engine.stats.decode_steps > decode_steps))

    for prompt, sampling in zip(prompts, params, strict=True):  # arrivals while others decode
        engine.add_request(prompt, sampling)
        guarded_step()
    while engine.has_unfinished():
        guarded_step()
    assert all(reads == (1 if outputs else 0) for reads, outputs, _ in steps)
    assert steps[0][:2] == (0, 0), "the first step was not a partial prefill alone"
    assert {decodes_only for _, _, decodes_only in steps} == {True, False}
    assert engine.pool.is_completely_free


def test_the_engine_times_sampling_apart_and_counts_each_phases_readbacks(tiny):
    stats = tiny.engine.stats
    before_s, before_readbacks, before_steps = dict(stats.phase_s), dict(stats.phase_readbacks), stats.steps
    solo(tiny, "hello", GREEDY)
    assert PHASES == ("schedule", "prepare", "forward", "sample", "collect")
    assert all(stats.phase_s[phase] > before_s[phase] for phase in PHASES)
    readbacks = {phase: stats.phase_readbacks[phase] - before_readbacks[phase] for phase in PHASES}
    assert readbacks == {**dict.fromkeys(PHASES, 0), "collect": stats.steps - before_steps}


def test_logprobs_report_the_chosen_token_and_n_alternatives(tiny):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    completion = solo(tiny, "hello", params)
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entry.token_id == token_id and len(entry.top) == 3
        assert entry.top[0][0] == token_id  # greedy picks the most likely token
        assert entry.logprob <= 0.0 and entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


@pytest.mark.real_model
def test_same_seed_same_text_and_temperature_zero_is_greedy(real):
    prompt = "Once upon a time"
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=123)
    assert solo(real, prompt, seeded).token_ids == solo(real, prompt, seeded).token_ids
    greedy = solo(real, prompt, SamplingParams(max_tokens=16, temperature=0.0))
    top_k_1 = solo(real, prompt, SamplingParams(max_tokens=16, temperature=1.7, top_k=1, seed=5))
    assert top_k_1.token_ids == greedy.token_ids


@pytest.mark.real_model
def test_different_seeds_at_high_temperature_give_different_text(real):
    texts = {solo(real, "My favourite food is", SamplingParams(max_tokens=12, temperature=2.0, seed=s)).text
             for s in range(4)}
    assert len(texts) > 1


# A real crowd of 16 staggered arrivals equals its solo runs: test_batch_invariance's
# test_real_crowd_of_16_gives_every_request_its_solo_tokens_and_logprobs (the same prompts and
# sampling, tokens and logprobs both).


def test_preemption_by_recompute_changes_no_token(tiny_model_dir):
    prompts = [f"request {i}:" + " hi" * i for i in range(8)]
    params = [SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 1.1, seed=i, ignore_eos=True)
              for i in range(8)]
    roomy = LLM(str(tiny_model_dir), device="cpu", batch_invariant=True)
    cramped = LLM(str(tiny_model_dir), device="cpu", batch_invariant=True, num_kv_blocks=14, block_size=4)
    expected = [c.token_ids for c in roomy.generate(prompts, params)]
    got = [c.token_ids for c in cramped.generate(prompts, params)]
    assert cramped.engine.scheduler.num_preemptions >= 3, "the pool was not small enough to preempt"
    assert roomy.engine.scheduler.num_preemptions == 0
    assert got == expected
    assert cramped.engine.pool.is_completely_free


def test_bad_requests_are_refused_before_any_engine_work(tiny):
    engine = tiny.engine
    steps = engine.stats.steps
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("hi", SamplingParams(logit_bias={10**6: 1.0}))
    assert err.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("hi " * 5000, SamplingParams(max_tokens=4))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("", SamplingParams())
    assert err.value.param == "prompt"
    assert engine.stats.steps == steps and not engine.has_unfinished()


def test_prompt_logits_equal_the_first_generated_tokens_logits(tiny):
    logits = tiny.prompt_logits(["hello world"])
    greedy = solo(tiny, "hello world", SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert greedy.token_ids == [int(torch.argmax(logits[0]))]
