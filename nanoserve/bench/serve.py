"""The online bench: streaming clients against an OpenAI-compatible server, and the same
workload on the offline engine in the same run.

Owns: the text workload (prompts of `input_len` words drawn with a seed), the client (httpx
async streaming of /v1/completions, or /v1/chat/completions with each prompt as one user
message, with usage; Poisson arrivals or all at once; at most
`max_concurrency` requests in flight), vLLM `bench serve`'s metrics under its key names
(`mean_ttft_ms`, `median_tpot_ms`, `p99_itl_ms`, `output_throughput`, `request_throughput`,
`completed`, `failed`, ...), starting a `nanoserve serve` process on a loopback port when asked,
and the offline figure: the same prompts and parameters through one in-process engine with
the same number of requests in flight (driven by `driver.run_closed_loop`).
Refuses: printing and file formats beyond one CSV (the CLI does those); asserting timings.

Definitions (vLLM's): TTFT is from sending the request to its first streamed token; ITL is
the time between consecutive streamed chunks; TPOT is (E2EL - TTFT) / (output tokens - 1);
E2EL is from sending to the last byte; on chat, the first token is the first chunk that carries
content (the role-only chunk before it is not a token); throughputs divide by the wall time of the whole pass;
mean, median, std and p99 are `driver.latency_ms`'s (p99 by linear interpolation, as numpy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from nanoserve.bench.driver import RequestTimes, latency_ms, run_closed_loop

# Common English words: with SmolLM2's tokenizer nearly every " word" is one token.
WORDS_TEXT = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education good new first last long
great little own other old right big high different small large next early young important
few public bad same able make know take see come think look want give use find tell ask
seem feel try leave call keep let begin show hear play run move live believe hold bring
"""
WORDS = tuple(WORDS_TEXT.split())


def words(count: int, rng: random.Random) -> str:
    """`count` words of WORDS drawn by `rng`, space-separated."""
    return " ".join(rng.choice(WORDS) for _ in range(count))
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class Workload:
    num_prompts: int
    input_len: int  # words; the server's usage reports the tokens
    output_len: int
    seed: int = 0
    shared_prefix_len: int = 0  # leading words every prompt shares, whatever the seed (a system prompt)

    def prompts(self) -> list[str]:
        prefix = random.Random(-1).choices(WORDS, k=self.shared_prefix_len)
        rng = random.Random(self.seed)
        rest = self.input_len - self.shared_prefix_len
        return [" ".join(prefix + [rng.choice(WORDS) for _ in range(rest)]) for _ in range(self.num_prompts)]


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0


# -- the client -----------------------------------------------------------------------------------

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


async def send_request(client: httpx.AsyncClient, model: str, prompt: str, output_len: int,
                       endpoint: str = "completions") -> RequestResult:
    """One streaming completion (or chat completion), timed chunk by chunk."""
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", ENDPOINTS[endpoint], json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or (endpoint == "chat" and not _has_content(chunk)):
                    continue
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        result.e2el_s = time.perf_counter() - start
        result.success = result.output_tokens > 0
        if not result.success:
            result.error = "no usage chunk"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


def _has_content(chunk: dict) -> bool:
    delta = chunk["choices"][0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def arrival_gaps(count: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals, or none for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(count)]


async def run_clients(base_url: str, model: str, prompts: Sequence[str], output_len: int, *,
                      request_rate: float = math.inf, max_concurrency: int | None = None, seed: int = 0,
                      api_key: str | None = None, timeout_s: float = 600.0, endpoint: str = "completions"
                      ) -> tuple[list[RequestResult], float]:
    """Send every prompt; return each result and the wall time of the whole pass."""
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connections = httpx.Limits(max_connections=max_concurrency or len(prompts),
                               max_keepalive_connections=None)

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=connections,
                                 headers=headers) as client:
        async def one(prompt: str) -> RequestResult:
            async with limit:
                return await send_request(client, model, prompt, output_len, endpoint)

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, arrival_gaps(len(prompts), request_rate, seed), strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def served_model_name(base_url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, timeout=30, headers=headers) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


# -- metrics --------------------------------------------------------------------------------------

def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, float | int]:
    """vLLM `bench serve`'s figures, under its key names."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    samples = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2el_s for r in done],
    }
    metrics: dict[str, float | int] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    for name in PERCENTILE_METRICS:
        metrics |= percentiles_ms(name, samples[name])
    return metrics


def percentiles_ms(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """`mean_{name}_ms`, `median_`, `std_` and `p99_`: vLLM's key names for `latency_ms`."""
    return {f"{stat}_{name}_ms": value for stat, value in latency_ms(values_s).items()}


# -- the offline engine on the same workload ------------------------------------------------------

class OfflineRunner:
    """The same prompts and parameters through `LLM`'s engine in this process, keeping
    `concurrency` requests in flight (a finished one is replaced at once, as a waiting client
    would), timed the way the client times the server."""

    def __init__(self, engine_options: dict) -> None:
        from nanoserve.llm import LLM

        self.llm = LLM(**engine_options)

    def run(self, prompts: Sequence[str], output_len: int, concurrency: int) -> dict[str, float | int]:
        from nanoserve.sampling_params import SamplingParams

        self.llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        run = run_closed_loop(self.llm.engine, [(prompt, params) for prompt in prompts], concurrency)
        return summarize([as_streamed(times) for times in run.requests], run.elapsed_s)


def as_streamed(times: RequestTimes) -> RequestResult:
    """A request the driver ran to completion, as a streaming client would have timed it: each
    step's token is one chunk, and the request was sent when it was added."""
    return RequestResult(success=True, prompt_tokens=times.num_prompt_tokens, output_tokens=times.num_tokens,
                         ttft_s=times.token_s[0] - times.added_s, itl_s=times.inter_token_s,
                         e2el_s=times.finished_s - times.added_s)


# -- a server to measure --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def launched_server(serve_args: Sequence[str], *, log_path: Path, ready_timeout_s: float = 600.0
                    ) -> Iterator[str]:
    """`nanoserve serve` in a child process on a free loopback port; yields its base URL and
    stops it with SIGTERM (then SIGKILL) on the way out."""
    with launched_process(serve_args, log_path=log_path, ready_timeout_s=ready_timeout_s) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def launched_process(serve_args: Sequence[str], *, log_path: Path, ready_timeout_s: float = 600.0
                     ) -> Iterator[tuple[str, subprocess.Popen]]:
    """As `launched_server`, yielding the process too, for a caller that signals it itself; on
    the way out a process still running gets SIGTERM (then SIGKILL)."""
    port = free_port()
    command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *serve_args]
    base_url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(base_url, process, log_path, ready_timeout_s)
        yield base_url, process
    finally:
        stop_server(process)


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM, as a user's Ctrl-C would, then a kill if it has not left within a minute."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_ready(base_url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: "
                               f"{log_path.read_text(errors='replace')[-2000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready within {timeout_s:g} s")
        time.sleep(0.2)
