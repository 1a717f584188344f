"""DESIGN invariant 1 with the default settings: a request's tokens and logprobs, bit for bit, do
not depend on what shares its steps, on how its prompt was chunked, or on preemption.

Every engine here is built with no batch-invariance or kernel option: the defaults must give it.
Logprobs are compared as floats with ==, so one flipped low bit anywhere in the forward fails.
"""

import dataclasses

import pytest

import nanoserve.model.decoder
from nanoserve.config import PREFILL_PACE_MIN_TOKENS
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

LOGPROBS = 4


def params_for(i: int, max_tokens: int = 10) -> SamplingParams:
    """Even rows greedy, odd rows seeded top_p sampling; all report top-4 logprobs."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=LOGPROBS, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=i, logprobs=LOGPROBS,
                          ignore_eos=True)


def fingerprint(completion) -> list[tuple]:
    """Tokens with their logprobs and alternatives, exactly as floats."""
    return [(e.token_id, e.logprob, e.top) for e in completion.logprobs]


def staggered_crowd(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[tuple]]:
    """One new arrival every step while the earlier ones decode: every step has another batch."""
    engine = llm.engine
    order, entries = {}, {}
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        order[engine.add_request(prompt, sp)] = i
        for out in engine.step():
            entries.setdefault(out.request_id, []).extend(out.logprobs)
    while engine.has_unfinished():
        for out in engine.step():
            entries.setdefault(out.request_id, []).extend(out.logprobs)
    result = [None] * len(prompts)
    for request_id, i in order.items():
        result[i] = [(e.token_id, e.logprob, e.top) for e in entries[request_id]]
    assert engine.pool.is_completely_free
    return result


def crowd_prompts(count: int) -> list[str]:
    return [" ".join(["word"] * (1 + 3 * i)) + f" story {i}:" for i in range(count)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="module")
def real(default_llm):
    return default_llm


def test_the_default_engine_is_batch_invariant_with_a_kernel_that_passed_the_self_test(tiny):
    engine = tiny.engine
    assert engine.config.batch_invariant and engine.model.batch_invariant
    assert engine.kernel_choice.batch_invariant
    assert engine.kernel_choice.verdicts[engine.kernel_choice.kernel.name].invariant


def test_tiny_crowd_gives_every_request_its_solo_tokens_and_logprobs(tiny):
    prompts, params = crowd_prompts(12), [params_for(i) for i in range(12)]
    alone = [fingerprint(tiny.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(tiny, prompts, params) == alone


def test_with_the_torch_ops_a_tiny_crowd_still_gets_its_solo_tokens(tiny_model_dir, monkeypatch):
    """The path NANOSERVE_NO_NATIVE=1 (and half precision) takes, without the native small ops."""
    monkeypatch.setattr(nanoserve.model.decoder, "native_ops_for", lambda like: None)
    llm = LLM(str(tiny_model_dir), device="cpu")
    assert llm.engine.model.ops is None
    prompts, params = crowd_prompts(6), [params_for(i) for i in range(6)]
    alone = [fingerprint(llm.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(llm, prompts, params) == alone


@pytest.mark.real_model
def test_real_crowd_of_16_gives_every_request_its_solo_tokens_and_logprobs(real):
    prompts, params = crowd_prompts(16), [params_for(i) for i in range(16)]
    alone = [fingerprint(real.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(real, prompts, params) == alone


@pytest.mark.real_model
def test_a_token_scored_in_a_prefill_equals_the_same_token_scored_in_a_decode_step(real):
    """Request B's prompt is A's prompt plus A's first k tokens: B's first logprobs come from a
    prefill, A's (k+1)-th from a decode step, and they must be the same bits."""
    prompt = "The three primary colours are"
    first = real.generate([prompt], [params_for(0, max_tokens=8)])[0]
    prompt_ids = real.tokenizer.encode(prompt)
    for k in (1, 4, 7):
        continued = real.generate([prompt_ids + first.token_ids[:k]], [params_for(0, max_tokens=1)])[0]
        assert fingerprint(continued)[0] == fingerprint(first)[k], f"after {k} tokens"


def test_chunked_prefill_equals_one_prefill(tiny_model_dir):
    """A prompt prefilled in 5-token chunks (beside other requests) scores like one prefill."""
    prompts, params = crowd_prompts(6), [params_for(i) for i in range(6)]
    whole = LLM(str(tiny_model_dir), device="cpu", max_num_batched_tokens=512)
    chunked = LLM(str(tiny_model_dir), device="cpu", max_num_batched_tokens=5)
    expected = [fingerprint(c) for c in whole.generate(prompts, params)]
    assert [fingerprint(c) for c in chunked.generate(prompts, params)] == expected


def test_prompts_prefilled_beside_decodes_in_budgeted_chunks_equal_one_prefill(tiny_model_dir):
    """Arrivals while others decode prefill 3 tokens a step (the budget), or whole: same bits."""
    prompts, params = crowd_prompts(6), [params_for(i) for i in range(6)]
    unbounded = LLM(str(tiny_model_dir), device="cpu", max_prefill_tokens_while_decoding=512)
    budgeted = LLM(str(tiny_model_dir), device="cpu", max_prefill_tokens_while_decoding=3)
    expected = staggered_crowd(unbounded, prompts, params)
    assert staggered_crowd(budgeted, prompts, params) == expected


def test_a_paced_prefill_and_a_per_request_chunk_cap_equal_one_prefill(tiny_model_dir):
    """A lone long prompt paced to its measured cost (the pace's smallest steps), and prompts
    capped at 7 tokens a step (long_prefill_token_threshold): the same bits as unpaced."""
    prompts = [" ".join(["word"] * 80) + " story:", *crowd_prompts(3)]  # the first over 64 tokens
    params = [params_for(i) for i in range(4)]
    whole = LLM(str(tiny_model_dir), device="cpu", prefill_step_ms=float("inf"))
    paced = LLM(str(tiny_model_dir), device="cpu", prefill_step_ms=1e-6)
    capped = LLM(str(tiny_model_dir), device="cpu", long_prefill_token_threshold=7)
    assert whole.engine.scheduler.pace is None
    expected = [fingerprint(c) for c in whole.generate(prompts, params)]
    alone = [paced.generate([p], [q])[0] for p, q in zip(prompts, params, strict=True)]  # each paced alone
    assert [fingerprint(c) for c in alone] == expected
    prefill_steps = -(-len(paced.tokenizer.encode(prompts[0])) // PREFILL_PACE_MIN_TOKENS)
    assert paced.engine.stats.steps >= prefill_steps + 4 * 9 + 3  # the long prompt in the smallest steps
    assert paced.engine.scheduler.pace.s_per_unit is not None  # it measured its own prefill steps
    assert [fingerprint(c) for c in capped.generate(prompts, params)] == expected


def test_preemption_by_recompute_changes_no_token_nor_logprob(tiny_model_dir):
    prompts = [f"request {i}:" + " hi" * i for i in range(8)]
    params = [params_for(i, max_tokens=16) for i in range(8)]
    roomy = LLM(str(tiny_model_dir), device="cpu")
    cramped = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=14, block_size=4)
    expected = [fingerprint(c) for c in roomy.generate(prompts, params)]
    got = [fingerprint(c) for c in cramped.generate(prompts, params)]
    assert cramped.engine.scheduler.num_preemptions >= 3, "the pool was not small enough to preempt"
    assert got == expected
    assert cramped.engine.pool.is_completely_free


@pytest.mark.parametrize("block_size", [4, 48])
def test_block_sizes_that_do_not_divide_the_attention_chunk_keep_invariance(tiny_model_dir, block_size):
    """Contexts pad to whole 64-slot chunks whatever the block size (48 once crashed a prefill)."""
    llm = LLM(str(tiny_model_dir), device="cpu", block_size=block_size)
    prompts = [" ".join(["word"] * (70 + 9 * i)) for i in range(4)]
    params = [params_for(i, max_tokens=6) for i in range(4)]
    alone = [fingerprint(llm.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(llm, prompts, params) == alone


def test_rows_with_bad_words_or_allowed_token_ids_are_the_same_alone_and_in_a_crowd(tiny):
    """Per-row bans touch their own row only: constrained and unconstrained rows alike keep
    their solo tokens and logprobs beside each other."""
    prompts = crowd_prompts(8)
    free = [fingerprint(tiny.generate([p], [params_for(i)])[0]) for i, p in enumerate(prompts)]
    banned_word = tiny.tokenizer.decode([free[0][1][0]]).strip() or "word"
    allowed = tuple(sorted({e[0] for e in free[1]})[:3])
    params = [params_for(i) for i in range(8)]
    params[0] = SamplingParams(**{**_fields(params[0]), "bad_words": (banned_word,)})
    params[1] = SamplingParams(**{**_fields(params[1]), "allowed_token_ids": allowed})
    params[4] = SamplingParams(**{**_fields(params[4]), "allowed_token_ids": allowed,
                                  "bad_words": (banned_word,)})
    alone = [fingerprint(tiny.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(tiny, prompts, params) == alone
    assert all(i in (0, 1, 4) or alone[i] == free[i] for i in range(8))  # the others pay nothing
    assert {e[0] for e in alone[1]} <= set(allowed) and {e[0] for e in alone[4]} <= set(allowed)
    single = [ids for ids in (tiny.tokenizer.encode(banned_word, add_bos=False),
                              tiny.tokenizer.encode(" " + banned_word, add_bos=False)) if len(ids) == 1]
    assert not {e[0] for e in alone[0]} & {ids[0] for ids in single}
    assert alone[0] != free[0]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def own_params(i: int) -> SamplingParams:
    """Request i's own filters, penalties, bias and seed: one row's settings landing on another
    row changes that row's tokens."""
    filters = [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 20}, {"temperature": 1.2, "top_p": 0.7},
               {"temperature": 0.9, "min_p": 0.1}, {"temperature": 1.0, "typical_p": 0.6},
               {"temperature": 0.7, "top_n_sigma": 1.5}, {"temperature": 0.0, "repetition_penalty": 1.8},
               {"temperature": 0.0, "frequency_penalty": 1.5, "presence_penalty": 0.5}][i % 8]
    return SamplingParams(max_tokens=8, logprobs=LOGPROBS, ignore_eos=True, seed=100 + i,
                          logit_bias={20 + 13 * i: 3.0, 21 + 13 * i: -3.0}, **filters)


def test_a_crowd_where_every_request_samples_its_own_way_gives_each_its_solo_tokens(tiny):
    prompts, params = crowd_prompts(8), [own_params(i) for i in range(8)]
    alone = [fingerprint(tiny.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(tiny, prompts, params) == alone


def test_a_request_gets_the_logprobs_it_asked_for_whatever_its_neighbours_asked(tiny):
    """A step reads back the widest top-N any row asked for; each request still receives its own
    share: none when it asked for none, its own N alternatives otherwise."""
    asked = [None, 0, 1, 4, None, 2]
    params = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=n, ignore_eos=True) for n in asked]
    engine = tiny.engine
    prompts = crowd_prompts(6)
    ids = {engine.add_request(prompt, sp): sp.logprobs for prompt, sp in zip(prompts, params, strict=True)}
    seen = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out.logprobs)
    for request_id, wanted in ids.items():
        if wanted is None:
            assert seen[request_id] == [None] * 4
        else:
            assert all(len(entries) == 1 and len(entries[0].top) == wanted for entries in seen[request_id])


def test_a_fair_share_holds_a_many_choice_request_back_and_changes_no_bit(tiny_model_dir):
    """Six choices of one client request beside another's one: the share computes the six a few
    at a time, and every token and logprob of every choice is what it is with no share."""
    many = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, logprobs=LOGPROBS, ignore_eos=True)
    arrivals = [("many choices:", dataclasses.replace(many, seed=i), "many") for i in range(6)]
    arrivals.append(("one choice:", params_for(0, max_tokens=12), "one"))

    def run(fair_share_rows: float) -> tuple[list, int]:
        engine = LLM(str(tiny_model_dir), device="cpu", fair_share_rows=fair_share_rows).engine
        ids = [engine.add_request(prompt, sp, parent_id=parent) for prompt, sp, parent in arrivals]
        entries, most_rows, schedule = {i: [] for i in ids}, [0], engine.scheduler.schedule

        def recording():  # the most decode rows "many" got in a step it shared with "one"
            plan = schedule()
            parents = [chunk.request.parent for chunk in plan.chunks if chunk.is_decode]
            if "one" in parents:
                most_rows[0] = max(most_rows[0], parents.count("many"))
            return plan

        engine.scheduler.schedule = recording
        while engine.has_unfinished():
            for out in engine.step():
                entries[out.request_id] += [(e.token_id, e.logprob, e.top) for e in out.logprobs]
        return [entries[i] for i in ids], most_rows[0]

    unshared, unshared_rows = run(float("inf"))
    shared, shared_rows = run(0.0)
    # fair_share_rows 0: the lightest's one row a step, and now and then a second from what
    # the share carried over (a row's cost grows with its context, so shares are fractional).
    assert unshared_rows == 6 and shared_rows <= 2, "the share did not hold the six back"
    assert shared == unshared


def test_contended_steps_admit_round_robin_chunk_and_give_slots_and_change_no_bit(tiny_model_dir):
    """A long prompt prefilling, one client's many prompts holding every slot, and another's one
    arrival: with the fair share on, the arrival takes a slot from the client holding them all
    and runs beside the long prompt's prefill; every token and logprob is what it is with no
    share (which runs them first come first served)."""
    long_prompt = [5 + (i * 7) % 300 for i in range(400)]
    phases = [[(long_prompt, params_for(0, max_tokens=6), "long")],
              [(f"many {i}:", params_for(i, max_tokens=10), "many") for i in range(5)],
              [("one:", params_for(1, max_tokens=10), "one")]]

    def run(fair_share_rows: float) -> tuple[list, bool, int]:
        engine = LLM(str(tiny_model_dir), device="cpu", fair_share_rows=fair_share_rows, max_num_seqs=4,
                     max_num_batched_tokens=128).engine
        ids, entries, beside, schedule = [], {}, [False], engine.scheduler.schedule

        def recording():  # whether "one" ran in a step where the long prompt was still prefilling
            plan = schedule()
            parents = {chunk.request.parent: chunk for chunk in plan.chunks}
            beside[0] |= "one" in parents and "long" in parents and not parents["long"].samples
            return plan

        def step() -> None:
            for out in engine.step():
                entries[out.request_id] += [(e.token_id, e.logprob, e.top) for e in out.logprobs]

        engine.scheduler.schedule = recording
        for phase in phases:
            ids += [engine.add_request(prompt, sp, parent_id=parent) for prompt, sp, parent in phase]
            entries |= {i: [] for i in ids if i not in entries}
            for _ in range(2):
                step()
        while engine.has_unfinished():
            step()
        return [entries[i] for i in ids], beside[0], engine.scheduler.num_preemptions

    unshared, unshared_beside, _ = run(float("inf"))
    shared, shared_beside, preemptions = run(2.0)
    assert not unshared_beside and shared_beside, "the arrival did not run beside the prefill"
    assert preemptions >= 1, "no slot was given to the client with nothing running"
    assert shared == unshared
