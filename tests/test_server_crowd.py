"""Acceptance: a real `nanoserve serve` process on a loopback socket holds together in a crowd.

The server runs `--batch-invariant`, by default on the tiny random model (the default model is
too slow for this on 2 shared cores: its batch-invariant prefill of the long prompts alone
takes most of a minute; `NANOSERVE_CROWD_MODEL=default` runs the same test on SmolLM2-135M),
with a KV pool small enough that the crowd preempts. Every request first runs alone; then 40
clients at once mix streaming and unary, completions and chat, greedy and seeded sampling,
short and long prompts, n=2, and six of them hang up mid-request; three long runners, any two of
which outgrow the pool together, make the preemption certain. Each finished request must
match its solo run exactly (so none received another's tokens), the pool must come back
completely free, and the process must still be healthy. Then the official `openai` client, and
last a SIGTERM that drains and exits 0.
Bounded: every wait has a timeout; on the tiny model the file runs in well under a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from nanoserve.loading.default_model import resolve_model_dir

REPO = Path(__file__).resolve().parents[1]
NUM_CLIENTS = 40
HANG_UPS = {3, 9, 14, 22, 29, 35}  # streaming: read one chunk and leave; unary: time out
DRAIN_S = 2.0
MAX_TOKENS_LIMIT = 900
LONG_RUN_TOKENS = 440  # with its prompt, within the tiny model's 512-token context
CROWD_TIMEOUT_S = 240.0
LONG_TEXT = (
    "The history of the city begins with a small settlement on the river, where traders met to "
    "exchange grain, salt and cloth. Over the centuries the settlement grew into a market town, "
    "then into a walled city with a cathedral, a university and a harbour that sent ships to "
    "distant ports. Floods, fires and wars shaped its streets, and each generation rebuilt what "
    "the last had lost. Today its old quarter is a maze of narrow lanes, its museums keep the "
    "records of merchants and sailors, and its people still gather in the square on market day. "
) * 3


REAL = os.environ.get("NANOSERVE_CROWD_MODEL", "tiny") == "default"
# Sized per model: the long prompts fit the tiny model's 512-token context, and each pool is
# small enough that the crowd must preempt.
LONG_PROMPT = LONG_TEXT[:700] if REAL else LONG_TEXT[:400]
# Small enough that the crowd must preempt even with prefix-cache hits from the solo runs: 52
# blocks of 16 tokens on the tiny model. (0.001 GiB stopped preempting once steps got faster.)
KV_CACHE_GB = "0.03" if REAL else "0.0004"
# (Arrival order alone did not make it preempt: on the torch path, one CI run never did; the
# long runners below make it certain.)


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(server: Server, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.process.poll() is None, f"the server exited:\n{server.log()}"
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server never became healthy:\n{server.log()}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if REAL:
        model_dir = str(resolve_model_dir(None))
    else:
        from tiny_model import write_tiny_llama

        model_dir = str(write_tiny_llama(tmp_path_factory.mktemp("crowd_tiny")))
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve",
               "--model", model_dir, "--port", str(port), "--batch-invariant", "--max-num-seqs", "32",
               "--max-model-len", "1024", "--kv-cache-gb", KV_CACHE_GB,
               "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--drain-s", str(DRAIN_S),
               "--log-level", "warning"]
    with log_path.open("w") as log:
        # One intra-op thread on the tiny model: on a shared 2-core machine two threads spend
        # most of each step waiting for each other at barriers, and the test's time with them.
        env = os.environ if REAL else {**os.environ, "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    served = Server(process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_healthy(served)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=DRAIN_S + 15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


# -- the crowd ------------------------------------------------------------------------------------

@dataclass
class Call:
    """One client's request, and what it got back."""

    index: int
    path: str
    body: dict
    hang_up: bool = False
    choices: dict[int, dict] = field(default_factory=dict)  # index -> {text, finish_reason}
    usage: dict | None = None

    @property
    def chat(self) -> bool:
        return self.path.endswith("chat/completions")


def crowd_calls() -> list[Call]:
    calls = []
    for i in range(NUM_CLIENTS):
        chat = i % 2 == 1
        stream = (i // 2) % 2 == 0
        seeded = (i // 4) % 2 == 1
        long_prompt = i % 5 == 0
        text = f"Note {i}. " + (LONG_PROMPT if long_prompt else f"Tell me about the number {i * 7}.")
        body: dict = {"max_tokens": 8 + 8 * (i % 4), "stream": stream}
        body |= {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i} if seeded else {"temperature": 0}
        if seeded and i % 3 == 0:
            body["n"] = 2
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if stream and i % 4 == 0:
            body["stream_options"] = {"include_usage": True}
        hang_up = i in HANG_UPS
        if hang_up:
            body |= {"max_tokens": 400, "ignore_eos": True}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        calls.append(Call(i, path, body, hang_up))
    # Long runners: each alone fits the pool, any two running together outgrow it (2 x ~460
    # tokens against 52 blocks of 16), so the crowd preempts however its arrivals interleave;
    # one is seeded, so a preempted sampled row is also checked against its solo run.
    for j, sampling in enumerate(({"temperature": 0}, {"temperature": 0.8, "seed": 77},
                                  {"temperature": 0})):
        body = {"prompt": f"Note {NUM_CLIENTS + j}. Keep writing.", "max_tokens": LONG_RUN_TOKENS,
                "ignore_eos": True, "stream": j == 1, **sampling}
        calls.append(Call(NUM_CLIENTS + j, "/v1/completions", body))
    return calls


async def run_call(client: httpx.AsyncClient, call: Call) -> None:
    if call.hang_up:
        await hang_up(client, call)
    elif call.body["stream"]:
        await read_stream(client, call)
    else:
        response = await client.post(call.path, json=call.body)
        assert response.status_code == 200, response.text
        data = response.json()
        for choice in data["choices"]:
            text = choice["message"]["content"] if call.chat else choice["text"]
            call.choices[choice["index"]] = {"text": text, "finish_reason": choice["finish_reason"]}
        call.usage = data["usage"]


async def read_stream(client: httpx.AsyncClient, call: Call) -> None:
    ids = set()
    async with client.stream("POST", call.path, json=call.body) as response:
        assert response.status_code == 200
        # Lines starting with ":" are SSE comments (keep-alives while a stream waits): not events.
        events = [line.removeprefix("data: ") async for line in response.aiter_lines()
                  if line and not line.startswith(":")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        ids.add(chunk["id"])
        if chunk.get("usage"):
            call.usage = chunk["usage"]
        for choice in chunk["choices"]:
            entry = call.choices.setdefault(choice["index"], {"text": "", "finish_reason": None})
            entry["text"] += (choice["delta"].get("content") or "") if call.chat else choice["text"]
            entry["finish_reason"] = choice["finish_reason"] or entry["finish_reason"]
    assert len(ids) == 1  # every chunk carries this request's own id


async def hang_up(client: httpx.AsyncClient, call: Call) -> None:
    if call.body["stream"]:
        async with client.stream("POST", call.path, json=call.body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return  # leaving the block closes the connection mid-stream
    with contextlib.suppress(TimeoutError):  # usually gone long before the 400 tokens are done
        await asyncio.wait_for(client.post(call.path, json=call.body), 0.1)


async def run_crowd(base_url: str, calls: list[Call]) -> None:
    limits = httpx.Limits(max_connections=NUM_CLIENTS * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(run_call(client, call) for call in calls)), CROWD_TIMEOUT_S)


async def run_solo(base_url: str, calls: list[Call]) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        for call in calls:
            await asyncio.wait_for(run_call(client, call), 90)


def metric_values(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#") and "_bucket" not in line and "finished_reason" not in line}


def wait_pool_free(base_url: str, timeout_s: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = metric_values(base_url)
        if (values["nanoserve_requests_running"] == 0 and values["nanoserve_requests_waiting"] == 0
                and values["nanoserve_kv_cache_usage_ratio"] == 0
                and values["nanoserve_kv_cache_free_blocks"] == values["nanoserve_kv_cache_total_blocks"]):
            return values
        assert time.monotonic() < deadline, f"the pool never came back: {values}"
        time.sleep(0.05)


def without_cache_details(usage: dict) -> dict:
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def test_a_crowd_gets_exactly_its_solo_outputs_and_the_pool_comes_back(server: Server) -> None:
    calls = crowd_calls()
    solos = [Call(c.index, c.path, {**c.body, "stream": False}) for c in calls if not c.hang_up]
    for solo in solos:
        solo.body.pop("stream_options", None)
    asyncio.run(run_solo(server.base_url, solos))
    before = metric_values(server.base_url)

    asyncio.run(run_crowd(server.base_url, calls))

    for call, solo in zip([c for c in calls if not c.hang_up], solos, strict=True):
        assert call.choices == solo.choices, f"client {call.index} ({call.path}, {call.body})"
        if call.usage is not None:  # token counts equal; cached_tokens differ by what ran before
            assert without_cache_details(call.usage) == without_cache_details(solo.usage)
    after = wait_pool_free(server.base_url)
    assert after["nanoserve_num_preemptions_total"] > before["nanoserve_num_preemptions_total"], (
        "the crowd was meant to preempt; make the pool smaller")
    assert server.process.poll() is None
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


# -- the official client --------------------------------------------------------------------------

def test_the_official_openai_client_works(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id

    unary = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                      temperature=0)
    streamed = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == unary.choices[0].text
    assert unary.usage.completion_tokens == 8

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed_chat = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed_chat == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=messages, n=1000)
    assert bad.value.param == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x")
    assert missing.value.code == "model_not_found"


def test_the_api_key_can_come_from_the_environment(tmp_path: Path) -> None:
    from tiny_model import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "tiny")
    port = free_port()
    command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve",
               "--model", str(model_dir), "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "NANOSERVE_API_KEY": "from-env", "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    served = Server(process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_healthy(served)
        assert httpx.get(f"{served.base_url}/v1/models").status_code == 401
        authorized = httpx.get(f"{served.base_url}/v1/models", headers={"Authorization": "Bearer from-env"})
        assert authorized.status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=DRAIN_S + 30) == 0, served.log()


# -- shutdown (last: it stops the module's server) ------------------------------------------------

def test_sigterm_drains_in_flight_requests_then_exits_0(server: Server) -> None:
    async def scenario() -> tuple[list[str], list[str], BaseException | int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            short = {"prompt": "Count with me: one, two,", "max_tokens": 6, "temperature": 0,
                     "ignore_eos": True, "stream": True}
            # Completions default to 16 tokens; this one should outlast the drain (480 is the most
            # this pool admits for its prompt: more is a 400, and the stream never starts).
            long = {"prompt": "Tell me a long story.", "max_tokens": 480, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            started = asyncio.Event(), asyncio.Event()
            tasks = [asyncio.create_task(collect(client, body, flag))
                     for body, flag in ((short, started[0]), (long, started[1]))]
            await asyncio.wait_for(asyncio.gather(started[0].wait(), started[1].wait()), 60)
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            try:
                refused: BaseException | int = (await client.post("/v1/completions", json={"prompt": "a"})
                                                ).status_code
            except httpx.TransportError as error:
                refused = error
            short_events, long_events = await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_S + 30)
            return short_events, long_events, refused

    start = time.monotonic()
    short_events, long_events, refused = asyncio.run(scenario())
    assert server.process.wait(timeout=DRAIN_S + 30) == 0, server.log()
    assert time.monotonic() - start < DRAIN_S + 30
    assert refused == 503 or isinstance(refused, httpx.TransportError)
    assert short_events[-1] == "[DONE]"
    assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "[DONE]"
    last = json.loads(long_events[-2])
    if "error" in last:  # cut at the drain deadline: told why, never left hanging
        assert "shutting down" in last["error"]["message"]
    else:
        assert last["choices"][0]["finish_reason"] == "length"


async def collect(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> list[str]:
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()
    return events
