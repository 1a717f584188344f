"""Prefix caching changes no output: random workloads (shared and unshared prompts, aborts, a
pool small enough to preempt) give the same tokens and logprobs with the cache on and off,
and the pool's accounting holds after every step."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.sampling_params import SamplingParams

SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # a shared prefix: 2 full blocks and a bit


def make_engine(model_dir, prefix_caching: bool) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=4,
                               max_num_seqs=4, max_num_batched_tokens=12, num_kv_blocks=10,
                               batch_invariant=True, threads=1, enable_prefix_caching=prefix_caching))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return make_engine(tiny_model_dir, False), make_engine(tiny_model_dir, True)


def check_pool(engine: Engine) -> None:
    pool = engine.pool
    pool.check()
    held = [b for r in engine.scheduler.running for b in r.block_ids]
    assert all(pool.ref_count(b) == held.count(b) for b in set(held))
    assert pool.num_free_blocks == pool.num_blocks - len(set(held))
    assert all(not r.block_ids for r in engine.scheduler.waiting)


def run(engine: Engine, ops) -> dict[str, tuple]:
    """Each op: ("add", prompt, params) or ("step",) or ("abort", index); then to the end."""
    outputs: dict[str, list] = {}
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            request_id = engine.add_request(op[1], op[2])
            added.append(request_id)
            outputs[request_id] = []
        elif op[0] == "abort" and added:
            request_id = added[op[1] % len(added)]
            if engine.abort(request_id) is not None:
                outputs[request_id] = None  # aborted: not compared
        else:
            for out in engine.step():
                if outputs.get(out.request_id) is not None:
                    outputs[out.request_id].append((out.token_ids, out.logprobs))
        check_pool(engine)
    while engine.has_unfinished():
        for out in engine.step():
            if outputs.get(out.request_id) is not None:
                outputs[out.request_id].append((out.token_ids, out.logprobs))
        check_pool(engine)
    assert engine.pool.is_completely_free
    return outputs


prompts = st.one_of(
    st.lists(st.integers(3, 200), min_size=0, max_size=9).map(lambda tail: SYSTEM + tail),
    st.lists(st.integers(3, 200), min_size=1, max_size=16),
)
params = st.builds(
    lambda seed, max_tokens: SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 0.9,
                                            seed=seed, logprobs=2, ignore_eos=True),
    st.one_of(st.none(), st.integers(0, 5)), st.integers(1, 16))
ops = st.lists(st.one_of(
    st.tuples(st.just("add"), prompts, params),
    st.tuples(st.just("step")), st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), max_size=25)


@settings(max_examples=30, deadline=None)
@given(ops)
def test_outputs_with_the_cache_equal_outputs_without_it(engines, ops):
    off, on = engines
    expected, got = run(off, ops), run(on, ops)
    assert expected.keys() == got.keys()  # the same ids: both engines saw the same adds
    for request_id, steps in got.items():
        if steps is not None and expected[request_id] is not None:
            assert steps == expected[request_id], request_id


def test_a_shared_system_prompt_is_served_from_the_cache_and_reported(tiny_model_dir):
    engine = make_engine(tiny_model_dir, True)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request([*SYSTEM, 40], params, request_id="first")
    first = [o for _ in range(10) for o in engine.step()]
    engine.add_request([*SYSTEM, 41, 42], params, request_id="second")
    second = [o for _ in range(10) for o in engine.step()]
    assert {o.num_cached_tokens for o in first} == {0}
    assert {o.num_cached_tokens for o in second} == {8}
    assert engine.scheduler.prefix_cache_hits == 8
    assert engine.stats.prompt_tokens == 12 + (13 - 8)


def test_requests_with_different_cache_salts_share_no_block(tiny_model_dir):
    engine = make_engine(tiny_model_dir, True)

    def cached_tokens(salt: str | None) -> int:
        engine.add_request([*SYSTEM, 40], SamplingParams(max_tokens=1, temperature=0.0, cache_salt=salt))
        return [o for _ in range(10) for o in engine.step()][-1].num_cached_tokens

    assert cached_tokens("alice") == 0
    assert cached_tokens("bob") == 0  # the same prompt under another salt: nothing shared
    assert cached_tokens(None) == 0  # an unsalted request shares nothing with salted ones
    assert cached_tokens("alice") == 8  # the same salt does
    assert cached_tokens(None) == 8
