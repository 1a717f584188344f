"""The prefill pace, pinned with a fake clock: observed step seconds in, granted tokens out."""

import pytest

from nanoserve.config import SchedulerConfig
from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.prefill_pace import PrefillPace
from nanoserve.engine.request import NewToken, Request
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.step_cost import PROFILED
from nanoserve.sampling_params import SamplingParams

CONTEXT = PROFILED.context_tokens_per_row


def measured(s_per_unit: float, step_s: float = 0.15, min_tokens: int = 16) -> PrefillPace:
    pace = PrefillPace(step_s, min_tokens)
    pace.observe([(0, 100)], s_per_unit * pace.chunk_units(0, 100))
    return pace


def test_before_any_measurement_a_step_gets_the_smallest_grant_which_measures():
    pace = PrefillPace(0.15, 64)
    assert pace.tokens(0) == 64 and pace.tokens(3000) == 64


def test_a_step_is_granted_the_tokens_its_measured_cost_fits_in_the_step_time():
    pace = measured(0.001)  # 1 ms a unit: 150 units a step
    tokens = pace.tokens(0)
    assert pace.chunk_units(0, tokens) <= 150 < pace.chunk_units(0, tokens + 1)
    assert tokens > 100


def test_deeper_into_a_long_prompt_a_step_gets_fewer_tokens_for_the_same_time():
    pace = measured(0.001)
    grants = [pace.tokens(start) for start in (0, 1000, 2000, 3000)]
    assert grants == sorted(grants, reverse=True) and grants[0] > 2 * grants[-1], grants
    starts = (0, 1000, 2000, 3000)
    assert all(pace.chunk_units(start, n) <= 150 for start, n in zip(starts, grants, strict=True))


def test_rows_beside_the_prompt_take_their_units_out_of_the_step_and_the_floor_still_holds():
    pace = measured(0.001)  # 150 units a step
    beside = pace.tokens(0, reserved_units=60)
    assert pace.chunk_units(0, beside) <= 90 < pace.chunk_units(0, beside + 1)
    assert pace.tokens(0, reserved_units=1000) == 16


def test_a_slower_machine_gets_smaller_steps_and_the_grant_never_falls_below_its_floor():
    assert measured(0.002).tokens(0) < measured(0.001).tokens(0)
    assert measured(1.0).tokens(0) == 16


def test_the_estimate_follows_the_newest_steps_and_ignores_empty_ones():
    pace = measured(0.001)
    for _ in range(20):
        pace.observe([(0, 50), (200, 50)], 0.004 * (pace.chunk_units(0, 50) + pace.chunk_units(200, 50)))
    assert pace.s_per_unit == pytest.approx(0.004, rel=0.01)
    pace.observe([], 1.0)
    assert pace.s_per_unit == pytest.approx(0.004, rel=0.01)


@pytest.mark.parametrize(("field", "value"), [("step_s", 0.0), ("step_s", float("nan")), ("min_tokens", 0)])
def test_bad_pace_values_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        PrefillPace(**({"step_s": 0.1, "min_tokens": 8} | {field: value}))


@pytest.mark.parametrize(("field", "value"), [
    ("prefill_step_s", 0.0), ("prefill_step_s", -1.0), ("prefill_pace_min_tokens", 0),
    ("long_prefill_token_threshold", 0)])
def test_bad_scheduler_values_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def request(rid, prompt_len, parent, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, list(range(1, prompt_len + 1)), params, seed=0, parent_id=parent)


def step(scheduler, plan=None):
    """Run a planned step whose every sampled row gets token 7 (no request ends)."""
    plan = plan or scheduler.schedule()
    scheduler.update_after_step(plan, [NewToken(c.request.request_id, 7) for c in plan.chunks if c.samples])


def paced_scheduler(**config):
    config = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 8192,
              "max_prefill_tokens_while_decoding": 64, "fair_share_rows": 2.0, "prefill_step_s": 0.15,
              "prefill_pace_min_tokens": 16, "enable_prefix_caching": False} | config
    return Scheduler(SchedulerConfig(**config), BlockPool(1200, 16))


def test_a_lone_long_prompt_steps_at_its_pace_and_an_arrival_is_not_paced():
    scheduler = paced_scheduler()
    long = request("long", 3000, "long")
    scheduler.add(long)
    sizes, grants = [], []
    for _ in range(6):
        grants.append(scheduler.pace.tokens(long.num_computed_tokens))
        plan = scheduler.schedule()
        (chunk,) = plan.chunks
        sizes.append(chunk.num_tokens)
        scheduler.update_after_step(plan, [])
        scheduler.pace.observe([(chunk.start, chunk.num_tokens)], 0.001 * scheduler.pace.chunk_units(
            chunk.start, chunk.num_tokens))  # a fake clock: 1 ms a unit
    assert sizes[0] == 16  # nothing measured yet: the smallest step, which measures
    assert sizes == grants  # the pace's grant at the prompt's depth, from the steps before
    assert all(64 < size < 512 for size in sizes[1:]), sizes
    scheduler.add(request("ordinary", 40, "ordinary"))
    plan = scheduler.schedule()
    assert {c.request.request_id: c.num_tokens for c in plan.chunks}["ordinary"] == 40  # whole: not paced


def test_a_lone_clients_prompts_beside_its_own_decodes_are_paced_with_the_decodes_counted():
    # One request of n=8 choices: its first prompts decode while the rest are admitted. No one
    # else runs, so the fair share is off, but whoever arrives waits for this step: its prompt
    # tokens and its decode rows fit the pace's step together, not the prefill cap's 64 tokens.
    scheduler = paced_scheduler(prefill_step_s=0.05)
    scheduler.pace.observe([(0, 100)], 0.001 * scheduler.pace.chunk_units(0, 100))  # 1 ms a unit
    choices = [request(f"choice{i}", 30, "one", max_tokens=50) for i in range(8)]
    for choice in choices:
        scheduler.add(choice)
    step(scheduler)
    for _ in range(3):
        plan = scheduler.schedule()
        decodes = [c for c in plan.chunks if c.is_decode]
        prompt_tokens = sum(c.num_tokens for c in plan.chunks if not c.is_decode)
        reserved = sum(scheduler.share.units(1, c.start + 1) for c in decodes)
        assert decodes and 0 < prompt_tokens <= scheduler.pace.tokens(0, reserved_units=reserved) < 64
        step(scheduler, plan)


def test_the_per_request_threshold_caps_every_prompt_chunk_even_alone():
    scheduler = paced_scheduler(prefill_step_s=None, long_prefill_token_threshold=100)
    scheduler.add(request("long", 3000, "long"))
    scheduler.add(request("other", 500, "long"))
    plan = scheduler.schedule()
    assert [c.num_tokens for c in plan.chunks] == [100, 100]
