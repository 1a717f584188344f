"""Admission (`nanoserve/engine/admission.py`) and the one interface of the two engine bridges
(`nanoserve/server/bridges/engine_bridge.py`): the checks run over plain facts, the front the server
builds for data-parallel replicas refuses exactly what a replica's own engine refuses, and both
bridges implement the whole interface."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from nanoserve.config import EngineConfig
from nanoserve.engine.admission import InputProcessor
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams, StructuredOutputs
from nanoserve.server.bridges.async_engine import AsyncEngine
from nanoserve.server.bridges.engine_bridge import EngineBridge, EngineUnavailableError
from nanoserve.server.bridges.replicas import ReplicaPlan, ReplicaPool, ReplicaReady, replica_admission

ENGINE_OPTIONS = {"num_kv_blocks": 6, "block_size": 16, "max_num_seqs": 4, "threads": 1}


def facts_only(**facts) -> InputProcessor:
    """An admission with no tokenizer and no grammars: prompts of token ids, no grammar."""
    return InputProcessor(None, None, **{"vocab_size": 100, "max_model_len": 64, "num_blocks": 8,
                                         "block_size": 4, "task": "generate", "pooling_method": "last",
                                         "hidden_size": 32, "tensor_parallel": False, **facts})


def refusal(run) -> tuple[str, str | None]:
    with pytest.raises(InvalidRequestError) as refused:
        run()
    return refused.value.message, refused.value.param


def test_a_request_holds_at_most_the_context_or_the_whole_kv_pool_whichever_is_less() -> None:
    assert facts_only(max_model_len=64, num_blocks=8, block_size=4).max_request_tokens == 32
    assert facts_only(max_model_len=20, num_blocks=8, block_size=4).max_request_tokens == 20
    admission = facts_only(max_model_len=64, num_blocks=8, block_size=4)
    admission.check_request(list(range(31)), SamplingParams(max_tokens=1))
    too_long, too_many = list(range(32)), list(range(30))
    assert refusal(lambda: admission.check_request(too_long, SamplingParams(max_tokens=1)))[1] == "prompt"
    assert refusal(lambda: admission.check_request(too_many, SamplingParams(max_tokens=3)))[1] == "max_tokens"


def test_admission_refuses_token_ids_outside_the_vocabulary_and_an_empty_prompt() -> None:
    admission = facts_only(vocab_size=100)
    assert admission.encode_prompt([0, 99]) == [0, 99]
    for prompt in ([100], [-1], []):
        assert refusal(lambda prompt=prompt: admission.encode_prompt(prompt))[1] == "prompt"
    assert refusal(lambda: admission.check_request([1], SamplingParams(stop_token_ids=[100])))[1] == \
        "stop_token_ids"


def test_process_truncates_seeds_and_resolves_an_embedding_requests_pooling() -> None:
    admission = facts_only(pooling_method="mean")
    admitted = admission.process([1, 2, 3, 4, 5], SamplingParams(truncate_prompt_tokens=2, seed=7), None)
    assert admitted.prompt_ids == [4, 5] and admitted.seed == 7 and admitted.pooling is None
    unseeded = [admission.process([1], SamplingParams(), None).seed for _ in range(4)]
    assert len(set(unseeded)) > 1  # drawn per request, not one fixed seed
    pooled = admission.process([1, 2], SamplingParams(max_tokens=9, priority=3, cache_salt="s"),
                               PoolingParams())
    assert pooled.pooling.method == "mean"
    assert (pooled.params.max_tokens, pooled.params.priority, pooled.params.cache_salt) == (1, 3, "s")


def test_an_embed_engine_refuses_generation_and_a_tensor_parallel_one_refuses_pooling() -> None:
    assert refusal(lambda: facts_only(task="embed").process([1], SamplingParams(), None))[1] == "task"
    assert refusal(lambda: facts_only(tensor_parallel=True).check_pooling(PoolingParams()))[1] == "pooling"
    assert refusal(lambda: facts_only(hidden_size=32).check_pooling(PoolingParams(dimensions=16)))[1] == \
        "dimensions"


@pytest.fixture(scope="module")
def solo(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), **ENGINE_OPTIONS)


def test_the_replicas_admission_is_the_engines_own_and_refuses_as_it_does(tiny_model_dir, solo) -> None:
    engine = solo.engine
    config = EngineConfig(model=str(tiny_model_dir), **ENGINE_OPTIONS)
    ready = ReplicaReady(str(engine.model_dir), engine.model_config, engine.vocab_size, engine.max_model_len,
                         engine.pool.num_blocks, engine.kernel_choice.kernel.name, engine.kernel_summary,
                         engine.pooling_method)
    front = replica_admission(config, ready)
    facts = [f.name for f in dataclasses.fields(InputProcessor) if f.name not in ("tokenizer", "grammars")]
    assert {name: getattr(front, name) for name in facts} == {name: getattr(engine.admission, name)
                                                              for name in facts}
    too_long = list(range(1, front.max_request_tokens + 1))
    bad = [
        lambda a: a.encode_prompt([engine.vocab_size]),
        lambda a: a.encode_prompt(""),
        lambda a: a.check_request(too_long, SamplingParams(max_tokens=1)),
        lambda a: a.check_request([1, 2], SamplingParams(max_tokens=front.max_request_tokens)),
        lambda a: a.check_request([1], SamplingParams(logit_bias={engine.vocab_size: 1.0})),
        lambda a: a.check_request([1], SamplingParams(structured_outputs=StructuredOutputs(regex="("))),
        lambda a: a.check_pooling(PoolingParams(dimensions=engine.model_config.hidden_size + 1)),
    ]
    for run in bad:
        assert refusal(lambda run=run: run(front)) == refusal(lambda run=run: run(engine.admission))
    assert front.encode_prompt("Hello there") == engine.admission.encode_prompt("Hello there")


def test_both_bridges_implement_the_whole_interface_and_refuse_work_while_loading() -> None:
    loop = asyncio.new_event_loop()
    try:
        bridges = [AsyncEngine(lambda: pytest.fail("never started"), loop),
                   ReplicaPool(ReplicaPlan(EngineConfig(threads=1), 2), loop)]  # abstract left: TypeError
        for bridge in bridges:
            assert isinstance(bridge, EngineBridge)
            assert bridge.admission is None and bridge.status == "loading" and not bridge.healthy
            with pytest.raises(EngineUnavailableError, match="the model is still loading"):
                bridge.check_available()
    finally:
        loop.close()
