"""Scheduler rules, pinned on plain integers: budgets, chunked prefill, preemption, abort."""

import itertools
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.config import SchedulerConfig
from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.scheduler import NewToken, Scheduler
from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=32, max_len=256,
                   prefix_caching=False, prefill_cap=None, fair_share=float("inf"), prefill_step_s=None):
    pool = BlockPool(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens_per_step, max_len,
                                     enable_prefix_caching=prefix_caching,
                                     max_prefill_tokens_while_decoding=prefill_cap,
                                     fair_share_rows=fair_share, prefill_step_s=prefill_step_s,
                                     prefill_pace_min_tokens=16), pool)


def make_request(rid, prompt_len, max_tokens=8, parent=None, **params):
    params = {"temperature": 0.0} | params  # greedy unless asked: a sampled row costs the share more
    return Request(str(rid), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **params),
                   seed=0, parent_id=parent)


def run_step(scheduler):
    """Run the planned step with a model that always samples 7 and stops only at max_tokens."""
    plan = scheduler.schedule()
    for chunk in plan.chunks:  # every planned token has a cache slot: no chunk of a preempted request
        assert chunk.request.status is RequestStatus.RUNNING, chunk.request.request_id
        needed = scheduler.pool.blocks_for_tokens(chunk.start + chunk.num_tokens)
        assert len(chunk.request.block_ids) >= needed
    new_tokens = []
    for chunk in plan.chunks:
        if chunk.samples:
            last = len(chunk.request.output_ids) + 1 >= chunk.request.params.max_tokens
            new_tokens.append(NewToken(chunk.request.request_id, 7,
                                       RequestStatus.FINISHED_LENGTH if last else None))
    scheduler.update_after_step(plan, new_tokens)
    return plan


def test_scheduler_module_does_not_import_torch():
    code = ("import sys, nanoserve.engine.scheduler, nanoserve.engine.block_pool; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_long_prompt_is_chunked_and_running_decodes_keep_going():
    scheduler = make_scheduler(max_tokens_per_step=16)
    short = make_request("short", 3, max_tokens=20)
    scheduler.add(short)
    run_step(scheduler)  # short: prefill, first token
    long = make_request("long", 40)
    scheduler.add(long)
    plan = run_step(scheduler)
    sizes = {c.request.request_id: c.num_tokens for c in plan.chunks}
    assert sizes == {"short": 1, "long": 15}  # the decode first, then what the budget leaves
    plan = run_step(scheduler)
    assert {c.request.request_id: c.num_tokens for c in plan.chunks} == {"short": 1, "long": 15}


def test_while_a_request_decodes_prefill_chunks_share_at_most_the_prefill_budget():
    scheduler = make_scheduler(max_tokens_per_step=64, prefill_cap=8)
    scheduler.add(make_request("short", 3, max_tokens=20))
    run_step(scheduler)  # short: prefill, first token
    for name in ("long", "later"):
        scheduler.add(make_request(name, 40))
    sizes = [{c.request.request_id: c.num_tokens for c in run_step(scheduler).chunks} for _ in range(2)]
    # The oldest prompt first (FCFS): the one behind it waits for the budget, not the decode.
    assert sizes == [{"short": 1, "long": 8}, {"short": 1, "long": 8}]


def test_with_nothing_decoding_a_prompt_takes_the_whole_step_budget():
    scheduler = make_scheduler(max_tokens_per_step=64, prefill_cap=8)
    scheduler.add(make_request("long", 100))
    assert [c.num_tokens for c in run_step(scheduler).chunks] == [64]


def test_a_zero_prefill_budget_is_refused_by_name():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        SchedulerConfig(max_prefill_tokens_while_decoding=0)


def test_admission_is_first_come_first_served_and_capped_by_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2, max_tokens_per_step=100)
    for i in range(4):
        scheduler.add(make_request(i, 5))
    plan = scheduler.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["0", "1"]


def test_request_that_can_never_fit_is_refused_at_admission():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_len=256)  # pool holds 16 tokens
    with pytest.raises(InvalidRequestError) as err:
        scheduler.check_fits(20, 8)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        scheduler.check_fits(10, 10)
    assert err.value.param == "max_tokens"
    scheduler.check_fits(10, 6)


def test_a_step_computes_its_chunks_appends_new_tokens_and_finishes_what_they_end():
    scheduler = make_scheduler(max_tokens_per_step=8)
    long, short = make_request("long", 10), make_request("short", 3)
    scheduler.add(long)
    scheduler.add(short)
    plan = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("long", 8)]
    scheduler.update_after_step(plan, [])  # a partial prefill samples nothing
    assert (long.num_computed_tokens, long.output_ids) == (8, [])
    plan = scheduler.schedule()
    stopped = RequestStatus.FINISHED_STOPPED
    scheduler.update_after_step(plan, [NewToken("long", 5), NewToken("short", 6, stopped)])
    assert (long.num_computed_tokens, long.output_ids, long.status) == (10, [5], RequestStatus.RUNNING)
    assert (short.output_ids, short.status, short.block_ids) == ([6], stopped, [])
    assert list(scheduler.requests) == ["long"] and scheduler.running == [long]


def test_out_of_blocks_preempts_the_newest_request_which_keeps_its_tokens():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_tokens_per_step=64)
    old, new = make_request("old", 8, max_tokens=12), make_request("new", 8, max_tokens=12)
    scheduler.add(old)
    scheduler.add(new)
    preempted = []
    for _ in range(30):
        if not scheduler.has_unfinished():
            break
        plan = run_step(scheduler)
        preempted += plan.preempted
    assert new in preempted and old not in preempted
    assert len(old.output_ids) == 12 and len(new.output_ids) == 12
    assert scheduler.pool.is_completely_free


def test_abort_frees_blocks_at_once_wherever_the_request_is():
    scheduler = make_scheduler(max_num_seqs=1)
    running, queued = make_request("r", 9), make_request("q", 9)
    scheduler.add(running)
    scheduler.add(queued)
    scheduler.schedule()
    assert running.block_ids and not queued.block_ids
    scheduler.finish(queued, RequestStatus.FINISHED_ABORTED)
    scheduler.finish(running, RequestStatus.FINISHED_ABORTED)
    assert scheduler.pool.is_completely_free and not scheduler.has_unfinished()
    assert not scheduler.requests


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                  st.integers(1, 30), st.integers(1, 12)),
        max_size=80,
    ),
    st.integers(6, 40),
    st.booleans(),
    st.sampled_from([None, 1, 5]),
    st.sampled_from([float("inf"), 0.0, 2.0]),
)
def test_random_add_step_abort_never_leaks_or_exceeds_budgets(ops, num_blocks, prefix_caching, prefill_cap,
                                                              fair_share):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_tokens_per_step=24,
                               prefix_caching=prefix_caching, prefill_cap=prefill_cap, fair_share=fair_share)
    live: list[Request] = []
    for i, (op, size, max_tokens) in enumerate(ops):
        if op == "add":  # three parents, so a fair share has someone to divide between
            request = make_request(i, size, max_tokens, parent=f"client-{size % 3}")
            try:
                scheduler.check_fits(size, max_tokens)
            except InvalidRequestError:
                assert size + max_tokens > scheduler.max_request_tokens
                continue
            scheduler.add(request)
            live.append(request)
        elif op == "abort" and live:
            request = live.pop(size % len(live))
            if not request.status.is_finished:
                scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        else:
            decoding = {r.request_id for r in scheduler.running if r.num_uncomputed_tokens == 1}
            plan = run_step(scheduler)
            assert plan.num_batched_tokens <= 24
            if decoding and prefill_cap is not None:
                assert sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1) <= prefill_cap
            # A prompt never crowds out a decode: each runs, unless the pool preempted it (or a
            # fair share holds its parent back; the drain below shows it is never for ever).
            served = {c.request.request_id for c in plan.chunks} | {r.request_id for r in plan.preempted}
            assert decoding <= served or fair_share != float("inf")
            assert len(scheduler.running) <= 4
            ids = [c.request.request_id for c in plan.chunks]
            assert len(ids) == len(set(ids))
        held = [b for r in scheduler.running for b in r.block_ids]
        scheduler.pool.check()
        assert all(scheduler.pool.ref_count(b) == held.count(b) for b in held), "reference counts off"
        assert scheduler.pool.num_free_blocks == num_blocks - len(set(held))
        for r in scheduler.running:  # a request's own growing block is never shared
            if r.num_computed_tokens % 4 and len(r.block_ids) > r.num_computed_tokens // 4:
                assert held.count(r.block_ids[r.num_computed_tokens // 4]) == 1
        assert all(not r.block_ids for r in scheduler.waiting)
        queued = [*scheduler.waiting, *scheduler.running]
        assert sorted(r.request_id for r in queued) == sorted(scheduler.requests), "registry out of step"
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
    assert not scheduler.has_unfinished(), "some request never finished"
    assert scheduler.pool.is_completely_free


def test_a_prompt_starting_with_computed_blocks_takes_them_and_prefills_only_the_rest():
    scheduler = make_scheduler(prefix_caching=True)
    first = make_request("a", 10, max_tokens=1)
    scheduler.add(first)
    run_step(scheduler)  # 10 tokens: blocks 0 and 1 full, registered; a finishes
    assert scheduler.pool.is_completely_free
    second = Request("b", [*range(1, 9), 50, 51, 52], SamplingParams(max_tokens=2), seed=0)
    scheduler.add(second)
    plan = scheduler.schedule()
    [chunk] = plan.chunks
    assert (chunk.start, chunk.num_tokens) == (8, 3)
    assert second.num_cached_tokens == 8
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (10 + 11, 8)


def test_a_whole_cached_prompt_still_computes_its_last_token():
    scheduler = make_scheduler(prefix_caching=True)
    scheduler.add(make_request("a", 8, max_tokens=1))
    run_step(scheduler)
    again = make_request("b", 8, max_tokens=1)
    scheduler.add(again)
    [chunk] = scheduler.schedule().chunks
    assert (chunk.start, chunk.num_tokens) == (4, 4) and chunk.samples


def test_requests_sharing_a_prefix_hold_its_blocks_together_and_keep_it_after_finishing():
    scheduler = make_scheduler(prefix_caching=True)
    scheduler.add(make_request("a", 9, max_tokens=4))
    run_step(scheduler)
    scheduler.add(make_request("b", 9, max_tokens=4))
    run_step(scheduler)
    a, b = scheduler.requests["a"], scheduler.requests["b"]
    assert a.block_ids[:2] == b.block_ids[:2] and a.block_ids[2] != b.block_ids[2]
    assert all(scheduler.pool.ref_count(block) == 2 for block in a.block_ids[:2])
    while scheduler.has_unfinished():
        run_step(scheduler)
    scheduler.pool.check()
    assert scheduler.pool.is_completely_free and scheduler.pool.num_cached_blocks >= 2


def test_a_preempted_request_readmits_through_the_cache_and_keeps_its_first_cached_count():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2, prefix_caching=True)
    scheduler.add(make_request("old", 8, max_tokens=12))
    run_step(scheduler)
    scheduler.add(make_request("new", 8, max_tokens=12))
    for _ in range(20):
        run_step(scheduler)
        if scheduler.num_preemptions:
            break
    victim = next(r for r in scheduler.requests.values() if r.num_preemptions)
    assert victim.block_ids == [] and victim.num_computed_tokens == 0
    cached_before = victim.num_cached_tokens
    while scheduler.has_unfinished():
        run_step(scheduler)
        scheduler.pool.check()
    assert victim.num_cached_tokens == cached_before
    assert scheduler.prefix_cache_hits > cached_before  # the re-admission found its own blocks
    assert scheduler.pool.is_completely_free


def test_caching_off_registers_and_finds_nothing():
    scheduler = make_scheduler()
    for rid in "ab":
        scheduler.add(make_request(rid, 9, max_tokens=1))
        run_step(scheduler)
    assert scheduler.pool.num_cached_blocks == 0 and scheduler.prefix_cache_queries == 0


def cached_tokens_at_admission(scheduler, rid, prompt):
    """How many tokens of a new request `prompt` the prefix cache supplies when it is admitted."""
    request = Request(rid, list(prompt), SamplingParams(max_tokens=1), seed=0)
    scheduler.add(request)
    plan = run_step(scheduler)
    [chunk] = [c for c in plan.chunks if c.request is request]
    while scheduler.has_unfinished():
        run_step(scheduler)
    return chunk.start


def test_a_blocks_cache_key_covers_every_token_before_it_however_its_keys_were_computed():
    """The prompt's keys are computed at admission, the blocks decoding fills one at a time
    later: either way the same tokens at another position, or after another prefix, hold
    other K/V and must not be served."""
    scheduler = make_scheduler(prefix_caching=True, max_tokens_per_step=4)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=8), seed=0)
    scheduler.add(a)
    while scheduler.has_unfinished():  # the model samples 7: blocks 2 and 3 fill while decoding
        run_step(scheduler)
    first, second, third, fourth = (a.token_ids(4 * i, 4 * i + 4) for i in range(4))
    assert (third, fourth) == ([9, 7, 7, 7], [7, 7, 7, 7])
    assert cached_tokens_at_admission(scheduler, "b", [*first, *second, *third, *fourth, 20]) == 16
    for rid, shifted in (("c", second), ("d", third), ("e", fourth)):
        assert cached_tokens_at_admission(scheduler, rid, [*shifted, 20]) == 0, shifted
    assert cached_tokens_at_admission(scheduler, "f", [0, 2, 3, 4, *second, *third, 20]) == 0


def test_only_full_computed_blocks_are_cached_and_a_block_filled_by_decoding_is_found():
    scheduler = make_scheduler(prefix_caching=True, max_tokens_per_step=64)
    a = make_request("a", 9, max_tokens=4)  # 9 prompt tokens, block 2 holds 1 of them
    scheduler.add(a)
    run_step(scheduler)
    assert scheduler.pool.num_cached_blocks == 2, "a block still filling was cached"
    while scheduler.has_unfinished():  # decoding fills block 2 (tokens 8..11) and starts block 3
        run_step(scheduler)
    assert scheduler.pool.num_cached_blocks == 3
    tokens = a.prompt_ids + a.output_ids  # 13 tokens: the last one never had its K/V computed
    assert cached_tokens_at_admission(scheduler, "b", [*tokens[:12], 40]) == 12
    assert cached_tokens_at_admission(scheduler, "c", [*tokens[:11], 40]) == 8


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.one_of(
        st.tuples(st.just("add"), st.lists(st.sampled_from([1, 2]), min_size=1, max_size=14),
                  st.integers(1, 6)),
        st.tuples(st.just("step")),
    ), max_size=40),
    st.integers(2, 4), st.integers(1, 9), st.integers(4, 24),
)
def test_a_block_served_from_the_cache_holds_exactly_the_tokens_up_to_its_end(ops, block_size, budget,
                                                                              num_blocks):
    """Prompts over two token ids, so equal blocks at other positions and after other prefixes
    are everywhere; a model of each block's content (what was computed into it, erased when
    the block is handed out fresh) must agree with every cache hit, and every cached block
    must be full and computed."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
                               max_tokens_per_step=budget, prefix_caching=True)
    content: dict[int, tuple[int, ...]] = {}  # block id -> every token up to the block's end
    for i, op in enumerate(ops + [("step",)] * 200):
        if op[0] == "add":
            try:
                scheduler.check_fits(len(op[1]), op[2])
            except InvalidRequestError:
                continue
            scheduler.add(Request(str(i), list(op[1]), SamplingParams(max_tokens=op[2]), seed=0))
            continue
        if not scheduler.has_unfinished():
            break
        held_before = {r.request_id: len(r.block_ids) for r in scheduler.running}
        plan = scheduler.schedule()
        new_tokens = []
        for chunk in plan.chunks:
            request, tokens = chunk.request, chunk.request.token_ids(0, chunk.request.num_tokens)
            hits = 0 if request.request_id in held_before else chunk.start // block_size
            for index in range(hits):
                assert content.get(request.block_ids[index]) == tuple(tokens[:(index + 1) * block_size])
            for block in request.block_ids[max(hits, held_before.get(request.request_id, 0)):]:
                content.pop(block, None)  # handed out fresh: whatever it held is gone
            end = chunk.start + chunk.num_tokens
            for index in range(chunk.start // block_size, end // block_size):
                content[request.block_ids[index]] = tuple(tokens[:(index + 1) * block_size])
            if chunk.samples:
                last = len(request.output_ids) + 1 >= request.params.max_tokens
                new_tokens.append(NewToken(request.request_id, 1 + sum(tokens) % 2,
                                           RequestStatus.FINISHED_LENGTH if last else None))
        scheduler.update_after_step(plan, new_tokens)
        scheduler.pool.check()
        assert scheduler.pool.num_cached_blocks <= len(content), "a block not full and computed is cached"
    assert scheduler.pool.is_completely_free


# The fair share (fair_share.py): while more than one parent (client request) runs and one
# decodes, each parent takes at most the lightest parent's row units plus `fair_share_rows`.

def decoding_crowd(scheduler, parents: dict[str, int], prompt_len=2, max_tokens=40, **params):
    """`parents[p]` requests of each parent, prefilled (one step each, nothing decoding yet)."""
    requests = [make_request(f"{p}{i}", prompt_len, max_tokens, parent=p, **params)
                for p, count in parents.items() for i in range(count)]
    for request in requests:
        scheduler.add(request)
    while any(not r.output_ids for r in requests):
        run_step(scheduler)
    return requests


def rows_by_parent(plan):
    rows: dict[str, int] = {}
    for chunk in plan.chunks:
        rows[chunk.request.parent] = rows.get(chunk.request.parent, 0) + chunk.num_tokens
    return rows


def test_a_parent_with_many_choices_takes_the_lightest_share_plus_the_extra_rows():
    scheduler = make_scheduler(max_num_seqs=16, max_tokens_per_step=64, fair_share=2.0)
    decoding_crowd(scheduler, {"heavy": 8, "light": 1})
    for _ in range(6):
        rows = rows_by_parent(run_step(scheduler))
        assert rows["light"] == 1  # the lightest runs whole
        assert 2 <= rows["heavy"] <= 3  # 1 + 2 row units, less what the short contexts cost


def test_sampled_rows_and_top_logprobs_cost_the_share_more_than_greedy_rows():
    rows = {}
    for name, params in {"greedy": {}, "sampled": {"temperature": 1.0, "logprobs": 20}}.items():
        scheduler = make_scheduler(max_num_seqs=16, max_tokens_per_step=64, fair_share=2.0)
        decoding_crowd(scheduler, {"heavy": 8}, **params)
        decoding_crowd(scheduler, {"light": 1})
        rows[name] = sum(rows_by_parent(run_step(scheduler))["heavy"] for _ in range(8))
    assert rows["sampled"] * 1.5 <= rows["greedy"], rows  # 1 + 0.3 + 20 x 0.04 units a row against 1


def test_choices_a_share_holds_back_take_turns():
    scheduler = make_scheduler(max_num_seqs=16, max_tokens_per_step=64, fair_share=2.0)
    heavy = [r for r in decoding_crowd(scheduler, {"heavy": 8, "light": 1}) if r.parent == "heavy"]
    for _ in range(12):
        run_step(scheduler)
        counts = [len(r.output_ids) for r in heavy]
        assert max(counts) - min(counts) <= 1, counts  # least advanced first


def test_a_parent_alone_and_a_crowd_of_equals_are_never_held_back():
    alone = make_scheduler(max_num_seqs=16, max_tokens_per_step=64, fair_share=0.0)
    decoding_crowd(alone, {"only": 8})
    assert rows_by_parent(run_step(alone)) == {"only": 8}
    equals = make_scheduler(max_num_seqs=16, max_tokens_per_step=64, fair_share=0.0)
    decoding_crowd(equals, {f"client{i}": 1 for i in range(8)})
    assert len(run_step(equals).chunks) == 8


def test_without_a_share_the_heavy_parent_takes_every_row():
    scheduler = make_scheduler(max_num_seqs=16, max_tokens_per_step=64)  # fair_share inf: off
    decoding_crowd(scheduler, {"heavy": 8, "light": 1})
    assert rows_by_parent(run_step(scheduler)) == {"heavy": 8, "light": 1}


def test_a_row_over_a_long_context_runs_every_few_steps_never_never():
    scheduler = make_scheduler(num_blocks=1200, max_tokens_per_step=512, max_len=8192, fair_share=2.0)
    long = make_request("long", 4000, max_tokens=40, parent="long")
    scheduler.add(long)
    while not long.output_ids:
        run_step(scheduler)
    decoding_crowd(scheduler, {"light": 1})
    # One row over 4,000 tokens costs 1 + 4000/600 = 7.7 units; the share gives 1 + 2 a step.
    ran = [any(c.request is long for c in run_step(scheduler).chunks) for _ in range(16)]
    assert 3 <= sum(ran) <= 5, ran
    assert not any(a and b for a, b in itertools.pairwise(ran)), "it saved its share, not banked more"


def test_a_long_prompt_is_chunked_to_its_share_and_a_short_arrival_prefills_whole():
    scheduler = make_scheduler(max_tokens_per_step=512, prefill_cap=64, fair_share=2.0)
    decoding_crowd(scheduler, {"light": 1})
    scheduler.add(make_request("long", 300, parent="long"))
    sizes = [rows_by_parent(run_step(scheduler)).get("long", 0) for _ in range(4)]
    assert all(1 <= size <= 3 for size in sizes), sizes
    scheduler.add(make_request("short", 40, parent="short"))
    assert rows_by_parent(run_step(scheduler))["short"] == 40  # a one-off: no share


def test_a_request_its_share_holds_back_lets_the_next_in_queue_pass():
    scheduler = make_scheduler(max_tokens_per_step=512, prefill_cap=64, fair_share=2.0)
    decoding_crowd(scheduler, {"light": 1})
    scheduler.add(make_request("long0", 300, parent="long"))
    scheduler.add(make_request("long1", 300, parent="long"))  # its sibling spent the share
    scheduler.add(make_request("other", 30, parent="other"))
    ran = {c.request.request_id for c in run_step(scheduler).chunks}
    assert ran == {"light0", "long0", "other"}


def test_a_negative_fair_share_is_refused_by_name():
    with pytest.raises(ValueError, match="fair_share_rows"):
        SchedulerConfig(fair_share_rows=-1.0)


def test_out_of_blocks_never_preempts_a_request_the_share_already_scheduled_this_step():
    # The share orders parents' requests together (A0, A1, then B0), so the newest running
    # request (A1) may already be in the plan when B0 needs a block the pool does not have.
    scheduler = make_scheduler(num_blocks=3, block_size=4, max_tokens_per_step=64, fair_share=5.0)
    for rid, prompt, parent in (("A0", 2, "A"), ("B0", 4, "B"), ("A1", 2, "A")):
        scheduler.add(make_request(rid, prompt, max_tokens=4, parent=parent))
    run_step(scheduler)  # prefill: one block each, the pool full
    plan = run_step(scheduler)  # B0's decode needs a second block
    assert [r.request_id for r in plan.preempted] == ["B0"]
    assert {c.request.request_id for c in plan.chunks} == {"A0", "A1"}


# Contended steps (the fair share on, more than one parent running or waiting): no one waits
# behind another client's prefill, its many prompts, or the slots it holds.

def chunk_sizes(plan):
    return {chunk.request.request_id: chunk.num_tokens for chunk in plan.chunks}


def test_a_long_prompt_alone_takes_the_whole_budget_and_an_arrival_beside_it_runs_at_once():
    scheduler = make_scheduler(num_blocks=1200, max_tokens_per_step=512, max_len=8192, prefill_cap=64,
                               fair_share=2.0)
    long = make_request("long", 4000, max_tokens=4, parent="long")
    scheduler.add(long)
    assert chunk_sizes(run_step(scheduler)) == {"long": 512}  # alone: full speed
    ordinary = make_request("ordinary", 40, max_tokens=16, parent="ordinary")
    scheduler.add(ordinary)
    steps = 0
    while not ordinary.status.is_finished:
        sizes = chunk_sizes(run_step(scheduler))
        steps += 1
        assert sizes.get("ordinary", 0) >= 1, (steps, sizes)  # in every step, from its arrival
        assert 1 <= sizes.get("long", 0) < 64, (steps, sizes)  # the long prompt still progresses
    assert steps == 16  # whole prompt in the first step (with its first token), then 15 decodes
    assert chunk_sizes(run_step(scheduler)) == {"long": 512}  # alone again: full speed again


def test_the_step_admitting_an_arrival_whole_already_holds_a_heavy_client_to_its_share():
    # The arrival's prompt is a one-off no share pays for; beside it the heavy client takes the
    # share of the arrival's first decode row (1 + 2 units), not all 16 of its rows.
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=32, max_tokens_per_step=512, prefill_cap=64,
                               fair_share=2.0)
    decoding_crowd(scheduler, {"heavy": 16})
    scheduler.add(make_request("ordinary", 40, max_tokens=16, parent="ordinary"))
    admitting = rows_by_parent(run_step(scheduler))
    assert admitting["ordinary"] == 40 and 1 <= admitting["heavy"] <= 3, admitting
    assert rows_by_parent(run_step(scheduler)) == {"ordinary": 1, "heavy": admitting["heavy"]}


def test_a_long_prompt_beside_an_arrival_gets_the_share_of_the_arrivals_first_decode_row():
    scheduler = make_scheduler(num_blocks=1200, max_tokens_per_step=512, max_len=8192, prefill_cap=64,
                               fair_share=2.0)
    scheduler.add(make_request("long", 3000, max_tokens=4, parent="long"))
    run_step(scheduler)
    scheduler.add(make_request("ordinary", 40, max_tokens=16, parent="ordinary"))
    admitting = chunk_sizes(run_step(scheduler))
    assert admitting["ordinary"] == 40 and 1 <= admitting["long"] <= 3, admitting


@pytest.mark.parametrize(("prefill_cap", "long_len"), [(64, 128), (None, 256)])
def test_one_arrivals_prompt_never_takes_the_prefill_budget_of_another_arriving_with_it(prefill_cap,
                                                                                        long_len):
    # Two clients arrive together: the contended step's budget holds a part for each, and the
    # long prompt, longer than the cap (or, with none, its part), is chunked to its share rather
    # than computed whole in both clients' budget, which left the 2-token prompt waiting a step.
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=2, max_tokens_per_step=256,
                               prefill_cap=prefill_cap, fair_share=2.0)
    scheduler.add(make_request("long", long_len, parent="long"))
    scheduler.add(make_request("short", 2, parent="short"))
    sizes = chunk_sizes(run_step(scheduler))
    assert sizes["short"] == 2 and 1 <= sizes["long"] < 64, sizes


def test_two_long_prompts_of_two_clients_take_turns_rather_than_one_waiting_for_the_other():
    scheduler = make_scheduler(num_blocks=600, max_tokens_per_step=512, max_len=4096, prefill_cap=64,
                               fair_share=2.0)
    for name in ("first", "second"):
        scheduler.add(make_request(name, 1000, max_tokens=2, parent=name))
    for _ in range(10):
        sizes = chunk_sizes(run_step(scheduler))
        assert sizes.get("first", 0) >= 1 and sizes.get("second", 0) >= 1, sizes
        assert sum(sizes.values()) <= 2 * 64  # the prefill cap's worth for each


def test_waiting_requests_are_admitted_round_robin_by_client_not_behind_one_clients_prompts():
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=8, max_tokens_per_step=128, prefill_cap=64,
                               fair_share=2.0)
    for i in range(12):
        scheduler.add(make_request(f"many{i}", 20, max_tokens=50, parent="many"))
    scheduler.add(make_request("one", 20, max_tokens=50, parent="one"))
    first = chunk_sizes(run_step(scheduler))
    assert first.get("one") == 20, first  # admitted whole in the first step, beside many0
    assert "many0" in first


def test_a_clients_further_prompts_are_charged_to_its_share_not_admitted_whole_beside_a_decode():
    # One request of 64 prompts x n=4: its first prompt is an arrival's one-off; the rest are its
    # steady work, so while another client decodes it takes the share's rows, prompts included.
    scheduler = make_scheduler(num_blocks=800, max_num_seqs=32, max_tokens_per_step=512, prefill_cap=64,
                               fair_share=2.0)
    decoding_crowd(scheduler, {"light": 1})
    for i in range(16):
        scheduler.add(make_request(f"many{i}", 20, max_tokens=50, parent="many"))
    first = rows_by_parent(run_step(scheduler))
    assert 20 < first["many"] <= 20 + 3, first  # its first prompt whole, then its share: 1 + 2 units
    for _ in range(8):
        rows = rows_by_parent(run_step(scheduler))
        assert rows["light"] == 1 and rows.get("many", 0) <= 4, rows  # 3 row units, carried at most one


def test_fair_share_off_keeps_first_come_first_served_admission():
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=2, max_tokens_per_step=128)
    for i in range(3):
        scheduler.add(make_request(f"many{i}", 20, max_tokens=50, parent="many"))
    scheduler.add(make_request("one", 20, max_tokens=50, parent="one"))
    assert set(chunk_sizes(run_step(scheduler))) == {"many0", "many1"}


def test_a_client_with_nothing_running_gets_a_slot_from_the_one_holding_them_all():
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=4, max_tokens_per_step=128, fair_share=2.0)
    heavy = decoding_crowd(scheduler, {"heavy": 4}, max_tokens=60)
    tokens_before = {r.request_id: list(r.output_ids) for r in heavy}
    one = make_request("one", 4, max_tokens=3, parent="one")
    scheduler.add(one)
    plan = run_step(scheduler)
    assert [r.request_id for r in plan.preempted] == ["heavy3"]  # the heavy client's newest
    assert heavy[3].output_ids == tokens_before["heavy3"]  # preempted by recompute: tokens kept
    assert "one" in chunk_sizes(plan)
    while not one.status.is_finished:
        assert not run_step(scheduler).preempted  # one slot given, no more taken
    run_step(scheduler)
    assert heavy[3].status is RequestStatus.RUNNING  # back once the slot is free


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 600), st.integers(1, 4)), min_size=1, max_size=12),
    st.integers(0, 6),
    st.integers(1, 60),
    st.sampled_from([None, 16, 64]),
    st.integers(2, 8),
    st.sampled_from([None, 0.15]),
)
def test_an_arrival_runs_in_every_step_beside_any_one_heavy_client(heavy, arrive_at, ordinary_len,
                                                                   prefill_cap, max_num_seqs, prefill_step_s):
    """Whatever one client holds (many prompts, long prompts, every slot), an ordinary request of
    another client gets a chunk in every step from its arrival until it finishes."""
    scheduler = make_scheduler(num_blocks=4000, block_size=4, max_num_seqs=max_num_seqs,
                               max_tokens_per_step=256, max_len=1024, prefill_cap=prefill_cap, fair_share=2.0,
                               prefill_step_s=prefill_step_s)  # a pace with nothing measured: 16 a step
    for i, (prompt_len, n) in enumerate(heavy):
        for j in range(n):
            scheduler.add(make_request(f"heavy{i}-{j}", prompt_len, max_tokens=200, parent="heavy"))
    for _ in range(arrive_at):
        run_step(scheduler)
    ordinary = make_request("ordinary", ordinary_len, max_tokens=8, parent="ordinary")
    scheduler.add(ordinary)
    steps = 0
    while not ordinary.status.is_finished:
        plan = run_step(scheduler)
        steps += 1
        assert any(chunk.request is ordinary for chunk in plan.chunks), steps
    assert steps <= ordinary_len + 8
    scheduler.pool.check()


# -- LoRA adapters: at most max_loras distinct ones a step --------------------------------------

def lora_scheduler(max_loras, num_blocks=4000, max_num_seqs=8, fair_share=float("inf"), prefix_caching=False):
    config = SchedulerConfig(max_num_seqs, 64, 1024, enable_prefix_caching=prefix_caching,
                             fair_share_rows=fair_share, max_running_adapters=max_loras)
    return Scheduler(config, BlockPool(num_blocks, 4))


def lora_request(rid, adapter, prompt_len=6, max_tokens=4, parent=None):
    request = make_request(rid, prompt_len, max_tokens=max_tokens, parent=parent)
    # The scheduler reads only an adapter's cache key (one per load).
    request.adapter = None if adapter is None else SimpleNamespace(cache_key=adapter)
    return request


def step_adapters(plan) -> set[str]:
    return {chunk.request.adapter_key for chunk in plan.chunks if chunk.request.adapter_key is not None}


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 3),
    st.lists(st.one_of(
        st.tuples(st.just("add"), st.sampled_from([None, "a", "b", "c", "d"]), st.integers(1, 40),
                  st.integers(1, 12), st.sampled_from(["p", "q", None])),
        st.tuples(st.just("step")),
    ), max_size=40),
    st.sampled_from([float("inf"), 2.0]),
    st.sampled_from([24, 4000]),
    st.booleans(),
)
def test_no_step_holds_more_than_max_loras_adapters_and_every_request_finishes(max_loras, ops, fair_share,
                                                                               num_blocks, prefix_caching):
    scheduler = lora_scheduler(max_loras, num_blocks=num_blocks, max_num_seqs=4, fair_share=fair_share,
                               prefix_caching=prefix_caching)
    count = itertools.count()

    def step():
        plan = run_step(scheduler)
        assert len(step_adapters(plan)) <= max_loras
        assert len({r.adapter_key for r in scheduler.running if r.adapter_key is not None}) <= max_loras
        scheduler.pool.check()

    for op in ops:
        if op[0] == "add":
            rid = next(count)
            scheduler.add(lora_request(rid, op[1], op[2], op[3], parent=op[4] and f"{op[4]}{rid % 2}"))
        else:
            step()
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        step()
    assert not scheduler.has_unfinished(), "a request never finished"
    assert scheduler.pool.is_completely_free


def test_a_waiting_adapter_is_served_while_the_running_adapters_requests_keep_arriving():
    """max_loras=1, adapter a runs and a new request of a arrives every step: b, arriving at step
    2, is admitted once the a requests that came before it finish, never behind the later ones."""
    scheduler = lora_scheduler(1)
    scheduler.add(lora_request("a0", "a", max_tokens=20))
    waiting_b = lora_request("b", "b", max_tokens=5)
    base = lora_request("base", None, max_tokens=3)
    admitted_at = None
    for index in range(1, 200):
        scheduler.add(lora_request(f"a{index}", "a", max_tokens=20))
        if index == 2:
            scheduler.add(waiting_b)
            scheduler.add(base)
        plan = run_step(scheduler)
        if index == 2:
            assert any(chunk.request is base for chunk in plan.chunks), "a base request waits for no slot"
        if admitted_at is None and any(chunk.request is waiting_b for chunk in plan.chunks):
            admitted_at = index
            assert step_adapters(plan) == {"b"}
        if waiting_b.status.is_finished:
            break
    assert admitted_at is not None and admitted_at <= 2 + 20 + 2
    assert waiting_b.status.is_finished


@pytest.mark.parametrize("step_tokens", [17, 24, 32])
@pytest.mark.parametrize("prefill_cap", [None, 5])
def test_no_chunk_ends_inside_a_bidirectional_image_and_the_chunk_reaching_one_takes_it_whole(
        step_tokens, prefill_cap):
    """Gemma 3's image rows see the whole image, so a chunk ends before an image or takes it
    whole, past the prefill cap beside a decode (vLLM's rule for bidirectional images); a
    causal image (the other families) is cut wherever the budget ends."""
    from nanoserve.multimodal.inputs import ImageInput

    scheduler = make_scheduler(max_tokens_per_step=step_tokens, prefill_cap=prefill_cap)
    decoding = make_request("decoding", 3, max_tokens=60)
    scheduler.add(decoding)
    run_step(scheduler)
    request = make_request("image", 70)
    bidirectional = ImageInput(b"a", None, tuple(range(7, 23)), bidirectional=True)
    causal = ImageInput(b"b", None, tuple(range(30, 46)))
    later = ImageInput(b"c", None, tuple(range(50, 66)), bidirectional=True)
    request.images = [bidirectional, causal, later]
    scheduler.add(request)
    cuts = []
    while request.num_computed_tokens < 70:
        for chunk in run_step(scheduler).chunks:
            if chunk.request is request:
                cuts.append(chunk.start + chunk.num_tokens)
    for image in (bidirectional, later):
        assert not any(image.positions[0] < cut <= image.last_position for cut in cuts), cuts
    if prefill_cap is not None:  # the image chunks go past the cap; the causal image is cut
        assert [b - a for a, b in itertools.pairwise([0, *cuts])].count(16) == 2, cuts
        assert any(causal.positions[0] < cut <= causal.last_position for cut in cuts), cuts
    assert scheduler.pool.num_free_blocks + len(decoding.block_ids) + len(request.block_ids) == 64


@pytest.mark.parametrize(("start", "granted", "step_tokens", "expected"), [
    (0, 12, 32, 7),  # would end inside [7, 23): ends before it
    (7, 3, 32, 16),  # reaches it: takes it whole, past its grant
    (12, 3, 32, 11),  # starts inside it (a cached prefix's end): the rest of it whole
    (7, 3, 15, 0),  # the step cannot hold it: none of it this step
    (12, 0, 32, 0),  # granted nothing: nothing
    (0, 23, 32, 23),  # ends at its end: as granted
    (25, 10, 32, 10),  # a causal image [30, 40) is cut anywhere
])
def test_whole_images_moves_a_chunk_end_out_of_a_bidirectional_image(start, granted, step_tokens, expected):
    from nanoserve.engine.scheduler import whole_images
    from nanoserve.multimodal.inputs import ImageInput

    request = make_request("image", 60)
    request.images = [ImageInput(b"a", None, tuple(range(7, 23)), bidirectional=True),
                      ImageInput(b"b", None, tuple(range(30, 40)))]
    assert whole_images(request, start, granted, step_tokens) == expected
