"""Deferred output (--async-scheduling) changes no output, and its one-step lag is real.

Random staggered workloads (hypothesis) run on an engine resolving each step at once and on
one resolving it a step late, over the tiny model: greedy and seeded rows, penalties (their
steps resolve at once), stop strings, EOS, max_tokens, aborts, a pool small enough to preempt,
the prefix cache on, and speculation. Then the lag itself: a request a stop token ends has one
overshoot row in the next step, discarded, and its blocks are already free; the readbacks of a
deferred run are one per step, none of them blocking while a later step is in flight.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from test_engine import readbacks_raise_outside_the_output_processor
from test_spec_decode import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_engines_agree,
    run_staggered,
    workloads,
)

from nanoserve.config import ASYNC_SCHEDULING_DEFAULT
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

COMMON = {"device": "cpu", "block_size": BLOCK_SIZE, "num_kv_blocks": NUM_BLOCKS, "max_num_seqs": 6}
PLAIN = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(resolved at once, deferred, deferred with speculation)."""
    return (LLM(str(tiny_model_dir), async_scheduling=False, **COMMON),
            LLM(str(tiny_model_dir), async_scheduling=True, **COMMON),
            LLM(str(tiny_model_dir), async_scheduling=True, speculative_tokens=4, speculative_ngram_min=1,
                **COMMON))


def test_the_default_is_the_named_constant_for_the_device(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=16)
    assert llm.engine.async_scheduling is ASYNC_SCHEDULING_DEFAULT["cpu"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(jobs=workloads())
def test_random_workloads_give_the_same_tokens_logprobs_and_text_with_deferred_output(engines, jobs):
    at_once, deferred, deferred_spec = engines
    assert_engines_agree(at_once, (deferred, deferred_spec), jobs)


def test_the_workloads_do_defer_overshoot_and_preempt(engines):
    """The property above could pass with nothing deferred: pin that steps are resolved late,
    that stop tokens overshoot, and that the pool preempts."""
    at_once, deferred, _ = engines
    prompts = [[5 + i, 6, 7, 8] * 11 for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True)
    free_run, _ = run_staggered(at_once, [(prompt, params, None) for prompt in prompts])
    # Every other request stops at its fifth token: a stop the scheduler cannot see coming.
    stopping = [dataclasses.replace(params, stop_token_ids=(free_run[i][0][4],)) for i in range(6)]
    jobs = [(prompt, stopping[i] if i % 2 else params, None) for i, prompt in enumerate(prompts)]
    stats, scheduler = deferred.engine.stats, deferred.engine.scheduler
    before = (stats.steps, stats.blocking_readbacks, stats.discarded_tokens, scheduler.num_preemptions)
    expected, _ = run_staggered(at_once, jobs)
    got, _ = run_staggered(deferred, jobs)
    assert got == expected
    assert any(expected[i][3] == "stop" for i in range(1, 6, 2))
    steps, blocking = stats.steps - before[0], stats.blocking_readbacks - before[1]
    assert blocking < steps / 2, "most steps were resolved before the next was launched"
    assert stats.discarded_tokens > before[2], "no request was scheduled once too often"
    assert scheduler.num_preemptions > before[3]


def test_a_request_a_stop_token_ends_runs_one_step_too_many_and_that_row_is_discarded(engines):
    at_once, deferred, _ = engines
    plain_ids = at_once.generate(["hello world"], PLAIN)[0].token_ids
    stop_id = plain_ids[3]
    engine = deferred.engine
    request_id = engine.add_request("hello world", SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,)))
    tokens: list[int] = []
    while True:
        outputs = engine.step()
        tokens += [t for out in outputs for t in out.token_ids]
        if any(out.finished for out in outputs):
            break
    assert tokens == plain_ids[:plain_ids.index(stop_id) + 1]
    # The step launched before this one was resolved has a row for the finished request ...
    assert request_id in engine._in_flight.tokens.request_ids
    # ... whose blocks are free already (the overshoot row wrote only into freed blocks).
    assert request_id not in engine.requests and engine.pool.is_completely_free
    discarded = engine.stats.discarded_tokens
    assert engine.step() == []
    assert engine.stats.discarded_tokens == discarded + 1
    assert not engine.has_unfinished()


def test_max_tokens_is_known_ahead_so_it_never_overshoots(engines):
    _, deferred, _ = engines
    engine = deferred.engine
    discarded, steps = engine.stats.discarded_tokens, engine.stats.steps
    completion = deferred.generate(["hello world"], PLAIN)[0]
    assert len(completion.token_ids) == 10 and completion.finish_reason == "length"
    assert engine.stats.discarded_tokens == discarded
    assert engine.stats.steps - steps == 10  # one prefill, nine decodes: no step too many


def test_a_deferred_run_reads_back_once_per_step_and_never_blocks_while_a_step_is_in_flight(engines):
    _, deferred, _ = engines
    engine = deferred.engine
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, logprobs=3, ignore_eos=True)
    for prompt, params in (("hello there", PLAIN), ("a b c", seeded)):
        engine.add_request(prompt, params)
    steps, readbacks = [], engine.readbacks.count
    blocking, launched = engine.stats.blocking_readbacks, engine.stats.steps
    while engine.has_unfinished():
        with readbacks_raise_outside_the_output_processor() as reads:
            outputs = engine.step()
        steps.append((len(reads), len(outputs)))
    assert all(reads <= 1 for reads, _ in steps)
    assert engine.readbacks.count - readbacks == engine.stats.steps - launched
    # Only the last step is read back with nothing launched after it.
    assert engine.stats.blocking_readbacks - blocking == 1
    assert steps[0] == (0, 0), "the first step was resolved before a second was launched"


def test_steps_with_rows_that_need_their_token_resolve_at_once(engines):
    _, deferred, _ = engines
    engine = deferred.engine
    blocking, steps = engine.stats.blocking_readbacks, engine.stats.steps
    penalized = dataclasses.replace(PLAIN, repetition_penalty=1.3)  # as long as PLAIN
    deferred.generate(["hello world", "a b c"], [PLAIN, penalized])
    assert engine.stats.blocking_readbacks - blocking == engine.stats.steps - steps


def test_on_cpu_the_forward_runs_in_its_thread_while_the_caller_collects(engines):
    _, deferred, _ = engines
    engine = deferred.engine
    threads = []
    forward, collect = engine.runner.forward, engine._collect

    def spy(name, call):
        def wrapped(*args):
            threads.append((name, threading.current_thread().name))
            return call(*args)
        return wrapped

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine.runner, "forward", spy("forward", forward))
        patch.setattr(engine, "_collect", spy("collect", collect))
        deferred.generate(["hello world"], PLAIN)
    assert ("forward", "MainThread") in threads  # the first step: nothing to collect beside it
    assert any(name == "forward" and thread.startswith("nanoserve-forward") for name, thread in threads)
    assert {thread for name, thread in threads if name == "collect"} == {"MainThread"}


def test_aborting_a_request_while_its_step_is_in_flight_gives_nobody_its_token(engines):
    at_once, deferred, _ = engines
    engine = deferred.engine
    victim = engine.add_request("hello world", PLAIN)
    engine.step()  # the prefill, launched and in flight
    engine.abort(victim)
    survivor = deferred.generate(["the quick brown"], PLAIN)[0]
    assert survivor.token_ids == at_once.generate(["the quick brown"], PLAIN)[0].token_ids
    assert engine.pool.is_completely_free and not engine.has_unfinished()
