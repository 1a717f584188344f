"""Priority scheduling (vLLM's --scheduling-policy priority): lower priority values are admitted
first and preempted last; fcfs ignores them; no token changes either way; a priority that is
not an integer is refused by name (SamplingParams, HTTP 400, CLI exit 2)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import make_request, run_step
from test_server_api import assert_error, idle_client, serving, tiny_engine
from typer.testing import CliRunner

from nanoserve.config import EngineConfig, SchedulerConfig
from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.request import RequestStatus
from nanoserve.engine.scheduler import Scheduler, priority_key
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from nanoserve_cli.main import app as cli_app


def priority_scheduler(num_blocks=64, max_num_seqs=8, budget=32, fair_share=float("inf"), policy="priority"):
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 256, fair_share_rows=fair_share,
                                     scheduling_policy=policy), BlockPool(num_blocks, 4))


def test_by_priority_the_lowest_value_is_admitted_first_and_arrival_breaks_ties():
    scheduler = priority_scheduler(max_num_seqs=2, budget=100)
    for rid, priority in [("late-low", 5), ("urgent", -1), ("normal-a", 0), ("normal-b", 0)]:
        scheduler.add(make_request(rid, 5, priority=priority))
    assert [c.request.request_id for c in scheduler.schedule().chunks] == ["urgent", "normal-a"]


def test_under_fcfs_priority_changes_nothing():
    scheduler = priority_scheduler(max_num_seqs=2, budget=100, policy="fcfs")
    for rid, priority in [("first", 5), ("second", -1), ("third", 0)]:
        scheduler.add(make_request(rid, 5, priority=priority))
    assert [c.request.request_id for c in scheduler.schedule().chunks] == ["first", "second"]


def test_out_of_blocks_preempts_the_lowest_priority_even_when_it_is_older():
    scheduler = priority_scheduler(num_blocks=8, budget=64)
    background = make_request("background", 8, 12, priority=10)
    urgent = [make_request(f"urgent-{i}", 4, 12) for i in range(2)]
    scheduler.add(background)
    run_step(scheduler)  # background runs alone first: the oldest
    for request in urgent:
        scheduler.add(request)
    preempted = []
    while scheduler.has_unfinished():
        preempted += run_step(scheduler).preempted
    # FCFS would preempt the newest (an urgent one) first.
    assert preempted and all(request is background for request in preempted)
    assert [len(r.output_ids) for r in (background, *urgent)] == [12, 12, 12]
    assert scheduler.pool.is_completely_free


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(InvalidRequestError) as error:
        EngineConfig(scheduling_policy="lifo")
    assert error.value.param == "scheduling_policy"


@pytest.mark.parametrize("priority", [1.5, "1", None, True])
def test_a_priority_that_is_not_an_integer_is_refused_by_name(priority):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(priority=priority)
    assert error.value.param == "priority"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(1, 24),
                       st.integers(1, 10), st.integers(-2, 2)), min_size=20, max_size=80),
    st.integers(6, 40),
    st.sampled_from([float("inf"), 2.0]),
)
def test_by_priority_the_queue_stays_ordered_victims_rank_lowest_and_nothing_leaks(ops, num_blocks,
                                                                                   fair_share):
    scheduler = priority_scheduler(num_blocks=num_blocks, max_num_seqs=4, budget=24, fair_share=fair_share)
    live = []
    for i, (op, size, max_tokens, priority) in enumerate(ops):
        if op == "add":
            if size + max_tokens > scheduler.max_request_tokens:
                continue
            request = make_request(i, size, max_tokens, parent=f"client-{size % 3}", priority=priority)
            scheduler.add(request)
            live.append(request)
        elif op == "abort" and live:
            request = live.pop(size % len(live))
            if not request.status.is_finished:
                scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        else:
            plan = run_step(scheduler)
            if plan.preempted:  # no request left running ranks below one the step preempted
                kept = [r.params.priority for r in scheduler.running]
                assert max(kept, default=-99) <= min(r.params.priority for r in plan.preempted)
        keys = [priority_key(r) for r in scheduler.waiting]
        assert keys == sorted(keys), "the waiting queue left (priority, arrival) order"
        scheduler.pool.check()
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
    assert not scheduler.has_unfinished(), "some request never finished"
    assert scheduler.pool.is_completely_free


def test_rows_preempted_by_priority_equal_their_solo_runs(tiny_model_dir):
    prompts = [f"request {i}:" + " hi" * i for i in range(8)]
    params = [SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 1.1, seed=i, ignore_eos=True)
              for i in range(8)]
    roomy = LLM(str(tiny_model_dir), device="cpu", batch_invariant=True)
    cramped = LLM(str(tiny_model_dir), device="cpu", batch_invariant=True, num_kv_blocks=14, block_size=4,
                  scheduling_policy="priority")
    expected = [c.token_ids for c in roomy.generate(prompts, params)]
    got = [c.token_ids for c in cramped.generate(prompts, params, priority=[i % 3 for i in range(8)])]
    assert cramped.engine.scheduler.num_preemptions >= 3, "the pool was not small enough to preempt"
    assert got == expected
    assert cramped.engine.pool.is_completely_free


def test_generate_takes_one_priority_per_prompt_and_refuses_a_count_that_differs(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=32, scheduling_policy="priority")
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1])
    assert error.value.param == "priority"
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(["a"], SamplingParams(max_tokens=2), priority=["high"])
    assert error.value.param == "priority"
    assert len(llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1, -1])) == 2


def test_both_endpoints_honour_an_integer_priority_and_refuse_anything_else(tiny_model_dir):
    with serving(lambda: tiny_engine(tiny_model_dir, scheduling_policy="priority")) as served, \
            idle_client(served) as http:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        completion = {"prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=completion | {"priority": -3}).status_code == 200
        assert http.post("/v1/chat/completions", json=chat | {"priority": 7}).status_code == 200
        for bad in (1.5, "1", None):
            assert_error(http.post("/v1/completions", json=completion | {"priority": bad}), 400, "priority")
            assert_error(http.post("/v1/chat/completions", json=chat | {"priority": bad}), 400, "priority")


def test_the_cli_refuses_an_unknown_scheduling_policy_by_name():
    result = CliRunner().invoke(cli_app, ["generate", "hi", "--scheduling-policy", "lifo"])
    assert result.exit_code == 2
    assert "--scheduling-policy" in result.output
