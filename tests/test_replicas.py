"""Data-parallel replicas (`nanoserve/server/bridges/replicas.py`): two engine processes behind one server.

A crowd spread over both replicas gives every request its solo tokens and logprobs; a replica
killed with SIGKILL is reported by /health and /metrics, its in-flight stream ends with an error
event rather than hanging, and the other replica serves on; replicas of two tensor-parallel
ranks each serve the solo greedy text; routing keeps a prompt's cached prefix (per salt) and a
client request's sequences on one replica; and `serve` refuses a split that leaves a replica
without a core, naming the option (`bench serve` a comparison on a server it did not start).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest
from server_harness import BackgroundServer
from typer.testing import CliRunner

from nanoserve.config import EngineConfig
from nanoserve.errors import NanoserveError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.app import build_app
from nanoserve.server.bridges.replicas import Replica, ReplicaPlan, ReplicaPool, ReplicaReady
from nanoserve_cli.main import app as cli_app

MODEL = "tiny"
ENGINE_OPTIONS = {"num_kv_blocks": 96, "max_num_seqs": 8, "threads": 1}
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time there was", "class Point:",
           "Hello, my name is", "import numpy as np", "The capital of France is", "for i in range(10):"]


@pytest.fixture(scope="module")
def solo(tiny_model_dir) -> LLM:
    """The engine every replica runs, alone in this process (its kernel is the replicas')."""
    return LLM(str(tiny_model_dir), **ENGINE_OPTIONS)


@contextlib.contextmanager
def replica_server(tiny_model_dir, solo: LLM, **options) -> Iterator[tuple[str, ReplicaPool]]:
    config = EngineConfig(model=str(tiny_model_dir), linear_kernel=solo.engine.kernel_choice.kernel.name,
                          **ENGINE_OPTIONS, **options)
    server_app = build_app(lambda: pytest.fail("one engine in this process"), model_names=[MODEL],
                           replicas=ReplicaPlan(config, 2))
    with BackgroundServer(server_app) as server:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            _wait_for(lambda: http.get("/health").status_code == 200, "the replicas never became ready")
        yield server.base_url, server_app.state.server.async_engine


def _wait_for(condition, message: str, timeout_s: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def _greedy(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}


def test_a_crowd_over_two_replicas_gets_its_solo_tokens_and_vectors_both_serve(tiny_model_dir, solo) -> None:
    lengths = [5 + 3 * i for i in range(len(PROMPTS))]
    expected = [solo.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0))[0]
                for p, n in zip(PROMPTS, lengths, strict=True)]
    with replica_server(tiny_model_dir, solo) as (base_url, _):

        async def crowd() -> list[dict]:
            async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
                responses = await asyncio.gather(*(
                    http.post("/v1/completions", json={"model": MODEL, "prompt": p, **_greedy(n)})
                    for p, n in zip(PROMPTS, lengths, strict=True)))
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
            return [r.json()["choices"][0] for r in responses]

        choices = asyncio.run(crowd())
        for choice, want in zip(choices, expected, strict=True):
            assert choice["text"] == want.outputs[0].text
            assert choice["logprobs"]["token_logprobs"] == [lp.logprob for lp in want.outputs[0].logprobs]
        metrics = httpx.get(f"{base_url}/metrics").text
        vectors = httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL, "input": PROMPTS[:2]}).json()
    assert [item["embedding"] for item in vectors["data"]] == [e.embedding for e in solo.embed(PROMPTS[:2])]
    served = {line.split('replica="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines() if line.startswith("nanoserve_generation_tokens_total{")}
    assert set(served) == {"0", "1"} and all(tokens > 0 for tokens in served.values()), served
    assert sum(served.values()) == sum(lengths)


def test_embeddings_over_two_replicas_equal_the_solo_vectors(tiny_model_dir, solo: LLM) -> None:
    expected = [result.embedding for result in solo.embed(PROMPTS)]
    with replica_server(tiny_model_dir, solo) as (base_url, _):

        async def crowd() -> list[list[float]]:
            async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
                responses = await asyncio.gather(*(http.post("/v1/embeddings", json={"input": p})
                                                   for p in PROMPTS))
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
            return [r.json()["data"][0]["embedding"] for r in responses]

        assert asyncio.run(crowd()) == expected


def test_two_replicas_of_two_tensor_parallel_ranks_serve_the_solo_greedy_text(tiny_model_dir, solo) -> None:
    prompts = PROMPTS[:4]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [solo.generate(p, params)[0].outputs[0].text for p in prompts]
    with replica_server(tiny_model_dir, solo, tensor_parallel_size=2) as (base_url, pool):

        async def crowd() -> list[str]:
            async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
                responses = await asyncio.gather(*(
                    http.post("/v1/completions", json={"model": MODEL, "prompt": p, **_greedy(12)})
                    for p in prompts))
            return [r.json()["choices"][0]["text"] for r in responses]

        # float32 over two ranks sums in another order than one: the greedy text is what must agree
        assert asyncio.run(crowd()) == expected
        assert all(replica.snapshot.generation_tokens > 0 for replica in pool.replicas)


def _stream(base_url: str, prompt: str, max_tokens: int, first_chunk: threading.Event, events: list) -> None:
    body = {"model": MODEL, "prompt": prompt, "stream": True, **_greedy(max_tokens)}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        events.append(response.status_code)
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                first_chunk.set()
    first_chunk.set()


def test_a_killed_replica_is_reported_its_stream_fails_and_the_other_serves(tiny_model_dir, solo) -> None:
    with replica_server(tiny_model_dir, solo) as (base_url, pool):
        streams = []
        # The least loaded: replica 0, then 1 (the first still runs: 480 tokens against the tiny
        # model's 512-token context).
        for prompt in ("The quick brown fox", "def fibonacci(n):"):
            started, events = threading.Event(), []
            thread = threading.Thread(target=_stream, args=(base_url, prompt, 480, started, events))
            thread.start()
            assert started.wait(60)
            streams.append((thread, events))
        victim = pool.replicas[1]
        assert victim.in_flight == 1 and pool.replicas[0].in_flight == 1
        os.kill(victim.process.pid, signal.SIGKILL)
        for thread, _ in streams:
            thread.join(60)
            assert not thread.is_alive(), "a stream hung"
        (survivor_status, *survivor), (victim_status, *victim_events) = (events for _, events in streams)
        assert survivor_status == victim_status == 200
        assert survivor[-1]["choices"][0]["finish_reason"] == "length"
        assert "error" in victim_events[-1] and "replica 1" in victim_events[-1]["error"]["message"]
        health = httpx.get(f"{base_url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "degraded" and "replica 1" in health.json()["replicas"][1]["error"]
        metrics = httpx.get(f"{base_url}/metrics").text
        assert 'nanoserve_engine_healthy{model_name="tiny",replica="1"} 0.0' in metrics
        assert 'nanoserve_engine_healthy{model_name="tiny",replica="0"} 1.0' in metrics
        after = httpx.post(f"{base_url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "def fibonacci(n):", **_greedy(6)})
        assert after.status_code == 200, after.text
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        want = solo.generate("def fibonacci(n):", params)[0]
        assert after.json()["choices"][0]["text"] == want.outputs[0].text


def test_a_replica_that_cannot_load_its_model_stops_the_server_naming_why(tmp_path) -> None:
    deaths: list[BaseException] = []
    config = EngineConfig(model=str(tmp_path / "missing"), **ENGINE_OPTIONS)
    server_app = build_app(lambda: pytest.fail("one engine in this process"), model_names=[MODEL],
                           replicas=ReplicaPlan(config, 2), on_engine_death=deaths.append)
    with BackgroundServer(server_app) as server:
        _wait_for(lambda: deaths, "the failed start was never reported")
        health = httpx.get(f"{server.base_url}/health")
    assert isinstance(deaths[0], NanoserveError) and "missing" in str(deaths[0])
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert [r["status"] for r in health.json()["replicas"]] == ["dead", "loading"]  # 1 never started


# -- routing, on replicas that are only bookkeeping (no processes) ----------------------------------

def _bookkeeping_pool(size: int = 2, block_size: int = 4) -> ReplicaPool:
    pool = ReplicaPool(ReplicaPlan(EngineConfig(block_size=block_size, threads=1), size),
                       asyncio.new_event_loop())
    pool.replicas = [Replica(index, None, ready=ReplicaReady("", None, 100, 64, 8, "aten", ""))
                     for index in range(size)]
    pool.ready = True
    return pool


def _add(pool: ReplicaPool, request_id: str, prompt_ids: list[int], *, salt: str | None = None,
         parent_id: str | None = None) -> int:
    pool.add(request_id, prompt_ids, SamplingParams(cache_salt=salt), asyncio.Queue(), parent_id=parent_id)
    return pool._routes[request_id].replica.index


def test_a_prompt_goes_to_the_replica_holding_its_prefix_for_its_salt_else_the_least_loaded() -> None:
    pool = _bookkeeping_pool()
    shared = list(range(1, 13))  # three full blocks of 4
    assert _add(pool, "a", [*shared, 50]) == 0
    assert _add(pool, "b", [99, 98, 97, 96, 95]) == 1  # no prefix anywhere: the least loaded
    assert _add(pool, "c", [*shared, 60]) == 0  # its prefix, though replica 0 is as loaded
    assert _add(pool, "d", [*shared, 70]) == 0  # now busier than replica 1, and still its prefix
    assert _add(pool, "e", [*shared, 80], salt="tenant-b") == 1  # another salt shares no block
    pool.abort("a")
    assert pool.replicas[0].in_flight == 2 and pool.num_in_flight == 4


def test_a_client_requests_sequences_stay_on_one_replica_and_the_dead_get_nothing() -> None:
    pool = _bookkeeping_pool()
    assert {_add(pool, f"r-{j}", [7, 8], parent_id="r") for j in range(4)} == {0}
    assert _add(pool, "other", [9]) == 1
    pool.replicas[1].exit_reason = "was killed by SIGKILL"
    assert _add(pool, "next", [9]) == 0
    pool.replicas[0].exit_reason = "was killed by SIGKILL"
    with pytest.raises(Exception, match="every data-parallel replica has stopped"):
        _add(pool, "last", [9])


def test_serve_refuses_a_split_leaving_a_replica_without_a_core() -> None:
    result = CliRunner().invoke(cli_app, ["serve", "--data-parallel-size", "4096"])
    assert result.exit_code == 2
    assert "--data-parallel-size" in result.output and "--threads 1" in result.output


def test_bench_serve_compares_replicas_only_on_servers_it_launches() -> None:
    result = CliRunner().invoke(cli_app, ["bench", "serve", "--base-url", "http://127.0.0.1:9", "-dp", "2"])
    assert result.exit_code == 2 and "--data-parallel-size" in result.output
