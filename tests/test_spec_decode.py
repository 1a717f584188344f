"""Speculative decoding changes no bit: tokens and logprobs with it on equal it off, `==`.

The proposer and the verification rule are tested alone; then random workloads (hypothesis)
run on two engines over the tiny model, one speculating and one not, with greedy and seeded
rows of every sampling mode, penalties, logit_bias, stop strings, min_tokens, aborts, a pool
small enough to preempt, and the prefix cache on. Drafts that always agree (the tokens the
plain engine produced) and always disagree pin both ends of the verification.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.config import SchedulerConfig
from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.core import Engine
from nanoserve.engine.request import NewToken, Request
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.spec_decode import (
    MAX_SPECULATIVE_TOKENS,
    DraftState,
    NgramIndex,
    SpecConfig,
    accepted_prefix,
    cheapest_drafts,
)
from nanoserve.engine.step_cost import PROFILED
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

# ---- the proposer and the rule, alone ------------------------------------------------------


def index_of(tokens: list[int], n_min: int = 1, n_max: int = 3) -> NgramIndex:
    index = NgramIndex(n_min, n_max)
    index.extend(tokens)
    return index


def test_prompt_lookup_proposes_what_followed_the_longest_matching_suffix():
    # suffix [1, 2, 3] occurred at 0..2 (followed by 9 9), [2, 3] also at 5..6 (followed by 7)
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 1, 2, 3]
    assert index_of(tokens).propose(2) == [9, 9]
    assert index_of(tokens, n_max=2).propose(2) == [7, 1]  # the latest copy of [2, 3]


def test_prompt_lookup_proposes_nothing_without_a_match_of_at_least_n_min():
    assert index_of([1, 2, 3, 4]).propose(3) == []
    assert index_of([5, 1, 2, 6, 2], n_min=2).propose(3) == []
    assert index_of([5, 1, 2, 6, 2], n_min=1).propose(3) == [6, 2]


def test_prompt_lookup_grown_token_by_token_equals_built_at_once():
    tokens = [4, 5, 4, 5, 6, 4, 5, 4]
    grown = NgramIndex(1, 3)
    for token in tokens:
        grown.extend([token])
    assert grown.propose(4) == index_of(tokens).propose(4) == [5, 6, 4, 5]


def test_a_loop_of_short_period_still_gets_k_drafts():
    # The latest copy of [3, 3, 3] ends one token from the end; the earliest has 4 after it.
    assert index_of([8] + [3] * 8).propose(4) == [3, 3, 3, 3]


def test_verification_accepts_the_drafts_equal_to_what_was_sampled_up_to_the_first_difference():
    assert accepted_prefix((5, 6, 7), [5, 6, 7, 8]) == 3
    assert accepted_prefix((5, 6, 7), [5, 9, 7, 8]) == 1
    assert accepted_prefix((5, 6, 7), [4, 6, 7, 8]) == 0


def test_drafting_backs_off_twice_as_long_after_each_fruitless_verification():
    state = DraftState(index_of([1, 2, 1, 2, 1]))
    paused = []
    for _ in range(3):
        state.record(drafted=4, accepted=0)
        paused.append(state.paused_for)
        while state.propose([], 4) == []:
            pass
    assert paused == [1, 2, 4]
    state.record(drafted=4, accepted=1)
    assert state.paused_for == 0 and state.propose([], 4) != []


@pytest.mark.parametrize(("field", "value"), [("speculative_tokens", -1),
                                              ("speculative_tokens", MAX_SPECULATIVE_TOKENS + 1),
                                              ("speculative_method", "eagle"),
                                              ("speculative_method", "draft"),
                                              ("speculative_ngram_min", 0),
                                              ("speculative_policy", "never"),
                                              ("speculative_disable_by_batch_size", 0)])
def test_bad_speculation_settings_raise_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field) as caught:
        Engine.__init__(Engine.__new__(Engine), _config(**{field: value}))
    assert isinstance(caught.value, InvalidRequestError) and caught.value.param == field


@pytest.mark.parametrize(("option", "value"), [("--speculative-policy", "never"),
                                                ("--speculative-disable-by-batch-size", "0")])
def test_the_cli_refuses_a_bad_draft_policy_naming_the_option(tiny_model_dir, option, value):
    from typer.testing import CliRunner

    from nanoserve_cli.main import app

    result = CliRunner().invoke(app, ["generate", "hello", "--model", str(tiny_model_dir), "--device", "cpu",
                                      "--speculative-tokens", "2", option, value])
    assert result.exit_code == 2 and option in result.output


def _config(**fields):
    from nanoserve.config import EngineConfig

    return EngineConfig(model="/nonexistent-model-dir", **fields)


def test_spec_config_accepts_its_stated_range():
    for k in (0, 1, MAX_SPECULATIVE_TOKENS):
        SpecConfig(k).check(draft_model=None)


# ---- the cost rule: how many drafts pay for their rows -----------------------------------------


def test_the_cost_rule_drafts_nothing_for_a_request_whose_drafts_are_never_accepted():
    for decoding in (1, 2, 16):
        assert cheapest_drafts([(0.0, 16)] * decoding, decoding, 16) == [0] * decoding


def test_the_cost_rule_drafts_all_it_can_for_a_request_whose_drafts_are_always_accepted():
    # Rows cost less than the tokens they bring whenever every draft is accepted (a step has a
    # fixed cost), whatever the batch: full acceptance drafts to the limit, except a draft that
    # would open a row group of the kernels (four rows) of its own: that one costs a group.
    for decoding in (1, 2, 16):
        assert cheapest_drafts([(1.0, 3)] * decoding, decoding, 16) == [3] * decoding  # its own limit
    assert cheapest_drafts([(1.0, 16)] * 16, 16, 16) == [16] * 16  # 272 rows: whole groups
    assert cheapest_drafts([(1.0, 16)] * 16, 16, 4) == [4] * 16  # K
    assert cheapest_drafts([(1.0, 16)], 1, 16) == [15]  # 16 rows; a 17th would open a group
    assert sum(cheapest_drafts([(1.0, 16)] * 2, 2, 4)) == 6  # 8 rows, not 10 in a group of 12


def test_one_draft_past_a_full_row_group_is_not_worth_a_group_at_sixteen_slots():
    # 16 rows fill four groups; a 17th row costs a fifth (~12 ms), more than 0.9 of a token
    # is worth when the step's 16 tokens take 59 ms: what made speculation lose at 16 slots.
    assert cheapest_drafts([(0.9, 4)] + [(0.0, 4)] * 15, 16, 4) == [0] * 16
    step_ms = PROFILED.step_ms
    assert step_ms(17) == step_ms(20) > step_ms(16) + 3 * (step_ms(16) - step_ms(8)) / 8


def test_the_cost_rule_drafts_half_accepted_requests_at_one_slot_and_not_at_sixteen():
    assert cheapest_drafts([(0.5, 16)], 1, 16) == [3]  # four rows cost barely more than two
    assert cheapest_drafts([(0.5, 16)] * 16, 16, 16) == [0] * 16


def test_the_drafts_the_cost_rule_takes_beat_every_other_choice_for_one_request():
    """Exhaustively, for one request: its k drafts give the best expected tokens per unit of cost."""
    def rate(decoding: int, acceptance: float, k: int) -> float:
        return (decoding + sum(acceptance ** i for i in range(1, k + 1))) / PROFILED.step_ms(decoding + k)

    for decoding in (1, 2, 4, 8, 16):
        for acceptance in (0.2, 0.5, 0.7, 0.9, 0.97):
            [k, *others] = cheapest_drafts([(acceptance, 16)] + [(0.0, 16)] * (decoding - 1), decoding, 16)
            best = max(rate(decoding, acceptance, j) for j in range(17))
            assert rate(decoding, acceptance, k) == best and not any(others), (decoding, acceptance)


def test_a_request_stops_drafting_when_its_drafts_are_rejected_and_tries_again_later():
    state = DraftState(index_of([1, 2, 1, 2, 1]))
    assert cheapest_drafts([(state.acceptance, 4)], 1, 4) == [3]  # a fourth would open a row group
    state.record(drafted=4, accepted=0)
    state.record(drafted=4, accepted=0)
    assert cheapest_drafts([(state.acceptance, 4)], 1, 4) == [0]
    steps = 0
    while cheapest_drafts([(state.acceptance, 4)], 1, 4) == [0]:
        state.idle()
        steps += 1
    assert steps < 64


def test_the_policy_always_and_the_batch_size_cut_off():
    always = SpecConfig(4, policy="always")
    assert always.allot([(0.0, 4), (1.0, 2)], 2) == [4, 2]
    cut = SpecConfig(4, policy="always", disable_by_batch_size=3)
    assert cut.allot([(1.0, 4)] * 2, 2) == [4, 4]
    assert cut.allot([(1.0, 4)] * 3, 3) == [0, 0, 0]
    assert SpecConfig(4, disable_by_batch_size=3).allot([(1.0, 4)] * 3, 3) == [0, 0, 0]


# ---- the scheduler's share: budget, max_tokens, no preemption for drafts, rollback -----------


def decoding(scheduler: Scheduler, *specs: tuple[str, int, int]) -> list[Request]:
    """Requests (id, prompt length, max_tokens) prefilled in one step, each given token 7."""
    requests = [Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0)
                for request_id, prompt_len, max_tokens in specs]
    for request in requests:
        scheduler.add(request)
    plan = scheduler.schedule()
    assert len(plan.chunks) == len(requests)
    scheduler.update_after_step(plan, [NewToken(request.request_id, 7) for request in requests])
    return requests


def test_drafts_fit_the_spare_budget_and_what_max_tokens_leaves():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=3), BlockPool(64, 4))
    [request] = decoding(scheduler, ("a", 3, 10))
    request.draft_ids = [1, 2, 3, 4]
    assert scheduler.schedule().chunks[0].draft_ids == (1, 2)  # budget 3: the token and 2 drafts
    scheduler = Scheduler(SchedulerConfig(), BlockPool(64, 4))
    [request] = decoding(scheduler, ("b", 3, 3))
    request.draft_ids = [1, 2, 3, 4]
    chunk = scheduler.schedule().chunks[0]
    assert chunk.draft_ids == (1,)  # 2 tokens left: at most 1 draft and the token after it
    assert chunk.num_tokens == 2 and chunk.samples and chunk.is_decode


def test_drafts_are_dropped_rather_than_preempting_anyone():
    scheduler = Scheduler(SchedulerConfig(), BlockPool(2, 4))
    request, other = decoding(scheduler, ("a", 3, 5), ("b", 3, 5))  # 4 tokens each: a block each
    request.draft_ids = [1, 2, 3]
    plan = scheduler.schedule()
    assert not plan.preempted and plan.chunks[0].draft_ids == ()
    assert other.status.name == "RUNNING"


def test_blocks_only_rejected_drafts_reached_are_freed_and_computed_tokens_count_accepted_ones():
    pool = BlockPool(16, 4)
    scheduler = Scheduler(SchedulerConfig(), pool)
    [request] = decoding(scheduler, ("a", 3, 12))  # 4 tokens, 1 block
    request.draft_ids = [11, 12, 13, 14, 15]
    plan = scheduler.schedule()
    assert len(request.block_ids) == 3  # positions 3..8
    # the run accepted 11, then sampled 20 instead of 12
    scheduler.update_after_step(plan, [NewToken("a", 11), NewToken("a", 20)])
    assert request.output_ids == [7, 11, 20]
    assert request.num_computed_tokens == 5 and request.num_uncomputed_tokens == 1
    assert len(request.block_ids) == 2 and pool.num_free_blocks == 14


# ---- the engine: speculation on == off --------------------------------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 40  # small enough that crowds preempt


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    common = {"device": "cpu", "block_size": BLOCK_SIZE, "num_kv_blocks": NUM_BLOCKS, "max_num_seqs": 6}
    return (LLM(str(tiny_model_dir), **common),
            LLM(str(tiny_model_dir), speculative_tokens=4, speculative_ngram_min=1, **common))


MODES = [
    {"temperature": 0.0},
    {"temperature": 0.7, "top_p": 0.8},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 0.7, "min_p": 0.2},
    {"temperature": 0.7, "typical_p": 0.8},
    {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3},
    {"temperature": 0.8, "top_k": 8, "repetition_penalty": 1.2, "logit_bias": ((5, 3.0), (9, -2.0))},
    {"temperature": 0.0, "logit_bias": ((274, 1.5),)},
    {"temperature": 0.7, "dry_multiplier": 1.5, "dry_allowed_length": 1},
    {"temperature": 0.9, "xtc_probability": 0.7, "xtc_threshold": 0.05},
    {"temperature": 0.9, "mirostat": 2, "mirostat_tau": 2.0},
]


@st.composite
def workloads(draw):
    count = draw(st.integers(1, 6))
    jobs = []
    for i in range(count):
        motif = draw(st.lists(st.integers(3, 40), min_size=1, max_size=4))
        prompt = (motif * draw(st.integers(1, 6)) + draw(st.lists(st.integers(3, 40), max_size=4)))
        extra = {}
        if draw(st.booleans()):
            extra["stop"] = (draw(st.sampled_from(["e", "a", "th", " ", "1"])),)
        max_tokens = draw(st.integers(1, 14))
        params = SamplingParams(max_tokens=max_tokens, seed=i + 100 * len(prompt),
                                logprobs=2, min_tokens=draw(st.integers(0, min(3, max_tokens))),
                                ignore_eos=draw(st.booleans()), **draw(st.sampled_from(MODES)), **extra)
        abort_at = draw(st.none() | st.integers(0, 8))
        jobs.append((prompt, params, abort_at))
    return jobs


def run_staggered(llm: LLM, jobs, propose=None) -> tuple[dict[int, tuple], dict[int, bool]]:
    """One arrival per step; request i aborted `abort_at` steps after it arrived. Returns each
    request's (tokens, logprobs, text, finish_reason) and whether it was aborted."""
    engine = llm.engine
    ids, got, aborted, step = {}, {}, {}, 0
    pending = list(enumerate(jobs))
    while pending or engine.has_unfinished():
        if pending:
            i, (prompt, params, abort_at) = pending.pop(0)
            abort_step = step + (abort_at if abort_at is not None else 10**9)
            ids[engine.add_request(prompt, params)] = (i, abort_step)
        for request_id, (i, abort_step) in ids.items():
            if step >= abort_step and request_id in engine.requests:
                engine.abort(request_id)
                aborted[i] = True
        if propose is not None:
            propose(engine)
        for out in engine.step():
            entry = got.setdefault(ids[out.request_id][0], ([], [], [], None))
            entry[0].extend(out.token_ids)
            entry[1].extend((e.token_id, e.logprob, e.top) for e in out.logprobs or [])
            entry[2].append(out.text)
            if out.finished:
                got[ids[out.request_id][0]] = (*entry[:3], out.finish_reason)
        step += 1
    assert engine.pool.is_completely_free
    return {i: (t, lp, "".join(text), reason) for i, (t, lp, text, reason) in got.items()}, aborted


def assert_engines_agree(reference: LLM, others, jobs) -> None:
    """Every engine in `others` gives the reference's outputs for the same staggered jobs."""
    expected, aborted_expected = run_staggered(reference, jobs)
    for llm in others:
        got, aborted = run_staggered(llm, jobs)
        assert_same_outputs(expected, got, aborted_expected, aborted)


def assert_same_outputs(plain, spec, aborted_plain, aborted_spec):
    for i in set(plain) | set(spec):
        if i in aborted_plain or i in aborted_spec:
            # Aborted at the same step, a speculating request may have got further: one run's
            # tokens and logprobs are a prefix of the other's.
            a, b = sorted((plain.get(i, ([], [], "", None)), spec.get(i, ([], [], "", None))),
                          key=lambda entry: len(entry[0]))
            assert b[0][:len(a[0])] == a[0] and b[1][:len(a[1])] == a[1], i
        else:
            assert spec[i] == plain[i], i


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(jobs=workloads())
def test_random_workloads_give_the_same_tokens_logprobs_and_text_with_speculation(engines, jobs):
    plain, spec = engines
    expected, aborted_plain = run_staggered(plain, jobs)
    got, aborted_spec = run_staggered(spec, jobs)
    assert_same_outputs(expected, got, aborted_plain, aborted_spec)


def test_the_random_workloads_do_draft_accept_and_preempt(engines):
    """The property above could pass with speculation never engaging: pin that it does."""
    plain, spec = engines
    greedy = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True)
    # 44-token prompts of their own (no prefix shared), 15 blocks each at the end: four alive
    # at once outgrow the 40-block pool.
    jobs = [([5 + i, 6, 7, 8] * 11, greedy, None) for i in range(6)]
    before = (spec.engine.stats.spec_draft_tokens, spec.engine.stats.spec_accepted_tokens,
              spec.engine.scheduler.num_preemptions)
    expected, _ = run_staggered(plain, jobs)
    got, _ = run_staggered(spec, jobs)
    assert got == expected
    stats = spec.engine.stats
    assert stats.spec_accepted_tokens - before[1] > 0
    assert stats.spec_draft_tokens - before[0] > stats.spec_accepted_tokens - before[1]  # some rejected
    assert spec.engine.scheduler.num_preemptions > before[2]


def test_no_drafts_are_proposed_while_the_batch_is_at_the_cut_off(tiny_model_dir):
    # No prefill pace: its first grant (nothing measured yet) is one prompt, and the other
    # request would then decode alone for a step, below the cut-off.
    common = {"device": "cpu", "block_size": BLOCK_SIZE, "num_kv_blocks": NUM_BLOCKS, "max_num_seqs": 6,
              "prefill_step_ms": float("inf")}
    plain = LLM(str(tiny_model_dir), **common)
    spec = LLM(str(tiny_model_dir), speculative_tokens=4, speculative_ngram_min=1,
               speculative_policy="always", speculative_disable_by_batch_size=2, **common)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    pair = [[5, 6, 7, 8] * 4, [9, 6, 7, 8] * 4]  # repeating prompts: prompt lookup finds drafts
    stats = spec.engine.stats
    assert spec.generate(pair, greedy) == plain.generate(pair, greedy)  # two decode in every step
    assert stats.spec_draft_tokens == 0
    assert spec.generate(pair[:1], greedy) == plain.generate(pair[:1], greedy)  # alone: below the cut-off
    assert stats.spec_draft_tokens > 0


def oracle(futures: dict[tuple[int, ...], list[int]], wrong: bool):
    """A proposer that knows each request's tokens from a plain run (drafts always agree), or
    proposes each of them plus one (always disagree): both ends of the verification."""

    def propose(engine: Engine) -> None:
        engine._propose_drafts = lambda: None
        for request in engine.scheduler.running:
            if request.params.carries_draw_state:  # mirostat: never drafted, as the proposers rule
                continue
            future = futures[tuple(request.prompt_ids)][len(request.output_ids):]
            request.draft_ids = [(t + 1) % 300 if wrong else t for t in future[:4]]

    return propose


@pytest.mark.parametrize("wrong", [False, True], ids=["drafts-always-agree", "drafts-always-disagree"])
def test_drafts_that_always_agree_or_always_disagree_change_nothing(tiny_model_dir, wrong):
    common = {"device": "cpu", "block_size": BLOCK_SIZE, "num_kv_blocks": NUM_BLOCKS, "max_num_seqs": 6}
    plain = LLM(str(tiny_model_dir), **common)
    spec = LLM(str(tiny_model_dir), speculative_tokens=4, **common)
    jobs = [([3 + i, 9, 4 + i], SamplingParams(max_tokens=12, seed=i, logprobs=3, ignore_eos=True, **mode),
             None) for i, mode in enumerate(MODES)]
    expected, _ = run_staggered(plain, jobs)
    futures = {tuple(prompt): expected[i][0] for i, (prompt, _, _) in enumerate(jobs)}
    got, _ = run_staggered(spec, jobs, propose=oracle(futures, wrong))
    assert got == expected
    stats = spec.engine.stats
    assert stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens == (0 if wrong else stats.spec_draft_tokens)


def test_metrics_export_drafted_and_accepted_tokens():
    from nanoserve.server.metrics import EngineSnapshot, ServerMetrics

    snapshot = EngineSnapshot(spec_draft_tokens=5, spec_accepted_tokens=3)
    text = ServerMetrics("m").render(snapshot, healthy=True).decode()
    assert 'nanoserve_spec_decode_draft_tokens_total{model_name="m"} 5.0' in text
    assert 'nanoserve_spec_decode_accepted_tokens_total{model_name="m"} 3.0' in text
