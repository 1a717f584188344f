"""The neighbour bench: how much one heavy but legal request slows an ordinary one.

Owns: the neighbour kinds (each a request body a hostile but legal client may send, and the
moment from which it is "heavy"), the ordinary request (greedy, 16 tokens, a fresh 32-word
prompt each time), and the protocol, side by side in one run against one server:

1. alone: the ordinary request with nothing else in flight;
2. during: the neighbour is sent and, once it is heavy, the ordinary request runs beside it
   (then the neighbour is cut: its streams are closed, so the server aborts it);
3. after: the ordinary request alone again, so a drift of the machine shows as after / alone.

"Heavy" is the neighbour's first streamed token for the kinds that hurt while they decode;
for `prefill-3000` it is the other way round: the ordinary request starts first, and the
3,000-token prompt is sent once its first token arrives, so every later token of the ordinary
request is made while the prompt prefills. Its ratio is therefore the time per output token
(TPOT) during / alone; every other kind's is the end-to-end time during / alone. For
`prefilling-3000` the same prompt is sent first and the ordinary request once the server runs
it (its running gauge in /metrics), so the ordinary request arrives behind a prefill already
under way; `prompts-64-n4` is one request carrying 64 prompts with 4 choices each (256
sequences, more than the server's slots).
Refuses: asserting timings, printing (the CLI prints), and any engine import: it is a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from nanoserve.bench.serve import words

ORDINARY_TOKENS = 16
ORDINARY_WORDS = 32
NEIGHBOUR_TOKENS = 2048  # enough to outlast the ordinary request even when it is slowed 25x
BODY_LIMIT_BYTES = 1 << 20  # `nanoserve serve --max-body-bytes`' default


@dataclass(frozen=True, slots=True)
class Timing:
    """One ordinary request: end-to-end seconds and time per output token after the first."""

    e2e_s: float
    tpot_s: float
    status: int = 200


@dataclass(frozen=True, slots=True)
class NeighbourResult:
    kind: str
    turn: int
    alone: Timing
    during: Timing
    after: Timing
    neighbour_status: int  # the neighbour's HTTP status: 400 once a cap refuses it

    @property
    def ratio(self) -> float:
        """during / alone: TPOT for the prefill kind, end-to-end time for the others."""
        if self.kind == "prefill-3000":
            return self.during.tpot_s / self.alone.tpot_s
        return self.during.e2e_s / self.alone.e2e_s

    def row(self) -> dict[str, float | int | str]:
        return {"neighbour": self.kind, "turn": self.turn, "ratio": self.ratio,
                "alone_s": self.alone.e2e_s, "during_s": self.during.e2e_s, "after_s": self.after.e2e_s,
                "alone_tpot_ms": 1e3 * self.alone.tpot_s, "during_tpot_ms": 1e3 * self.during.tpot_s,
                "after_tpot_ms": 1e3 * self.after.tpot_s,
                "after_vs_alone": self.after.e2e_s / self.alone.e2e_s,
                "neighbour_status": self.neighbour_status}


def _sampled(**fields: object) -> dict:
    return {"temperature": 1.0, "seed": 1, **fields}


def _stop_strings_filling(body_bytes: int, rng: random.Random) -> list[str]:
    """Distinct 60-character stop strings (that never occur) filling about `body_bytes` of JSON."""
    count = body_bytes // 64  # 60 characters, two quotes, a comma and a space
    return [f"{i:08d}" + "".join(rng.choices("qxzj", k=52)) for i in range(count)]


def neighbour_fields(kind: str, rng: random.Random) -> dict:
    """The neighbour's body fields beyond model and stream (prompt and max_tokens included)."""
    prompt = words(ORDINARY_WORDS, rng)
    plain = {"prompt": prompt, "max_tokens": NEIGHBOUR_TOKENS, "ignore_eos": True}
    bias = {str(1000 + i): 0.5 for i in range(1024)}
    kinds: dict[str, Callable[[], dict]] = {
        "plain-n1": lambda: plain | {"temperature": 0.0},
        "plain-n16": lambda: plain | {"temperature": 0.0, "n": 16},
        "logit-bias-n16": lambda: plain | _sampled(n=16, logit_bias=bias),
        "top-logprobs-n16": lambda: plain | _sampled(n=16, logprobs=20),
        "penalties-n16": lambda: plain | _sampled(n=16, presence_penalty=0.5, frequency_penalty=0.5,
                                                  repetition_penalty=1.2),
        "cached-context-4000": lambda: plain | {"prompt": CACHED_CONTEXT, "temperature": 0.0},
        "typical-sigma-n16": lambda: plain | _sampled(n=16, typical_p=0.9, top_n_sigma=1.0),
        "stop-1mib-n1": lambda: plain | {"temperature": 0.0, "stop": _stop_strings_filling(
            BODY_LIMIT_BYTES - 4096, rng)},
        "stop-1mib-n16": lambda: plain | {"temperature": 0.0, "n": 16, "stop": _stop_strings_filling(
            BODY_LIMIT_BYTES - 4096, rng)},
        "prefill-3000": lambda: {"prompt": words(3000, rng), "max_tokens": 16, "temperature": 0.0},
        "prefilling-3000": lambda: {"prompt": words(3000, rng), "max_tokens": 16, "temperature": 0.0},
        "prompts-64-n4": lambda: plain | {"prompt": [words(ORDINARY_WORDS, rng) for _ in range(64)],
                                          "temperature": 0.0, "n": 4},
    }
    if kind not in kinds:
        raise ValueError(f"unknown neighbour kind {kind!r}; the kinds are {', '.join(KINDS)}")
    return kinds[kind]()


KINDS = ("plain-n1", "plain-n16", "logit-bias-n16", "top-logprobs-n16", "penalties-n16",
         "cached-context-4000", "typical-sigma-n16", "stop-1mib-n1", "stop-1mib-n16", "prefill-3000",
         "prefilling-3000", "prompts-64-n4")
CACHED_CONTEXT = words(4000, random.Random(-4000))  # the same words every run: served once to warm


class Client:
    """Streaming completions on one connection pool; each call's timing or status."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.client, self.model = client, model

    async def ordinary(self, rng: random.Random, first_token: asyncio.Event | None = None) -> Timing:
        body = {"prompt": words(ORDINARY_WORDS, rng), "max_tokens": ORDINARY_TOKENS, "temperature": 0.0,
                "ignore_eos": True}
        start = time.perf_counter()
        first = None
        async with self._stream(body) as response:
            if response.status_code != 200:
                await response.aread()
                return Timing(time.perf_counter() - start, 0.0, response.status_code)
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    first = time.perf_counter()
                    if first_token is not None:
                        first_token.set()
        end = time.perf_counter()
        first = first or end
        return Timing(end - start, (end - first) / (ORDINARY_TOKENS - 1))

    async def neighbour(self, fields: dict, heavy: asyncio.Event, status: list[int]) -> None:
        """Stream the neighbour until cancelled; `heavy` is set at its first token (or refusal)."""
        try:
            async with self._stream(fields) as response:
                status.append(response.status_code)
                if response.status_code != 200:
                    await response.aread()
                    return
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and not heavy.is_set():
                        heavy.set()
        finally:
            heavy.set()

    def _stream(self, fields: dict) -> contextlib.AbstractAsyncContextManager[httpx.Response]:
        body = {"model": self.model, "stream": True, **fields}
        return self.client.stream("POST", "/v1/completions", content=json.dumps(body),
                                  headers={"Content-Type": "application/json"})


async def _during(client: Client, kind: str, rng: random.Random) -> tuple[Timing, int]:
    fields = neighbour_fields(kind, rng)
    heavy, status = asyncio.Event(), []
    if kind == "prefill-3000":
        first_token = asyncio.Event()
        ordinary = asyncio.create_task(client.ordinary(rng, first_token))
        await first_token.wait()
        task = asyncio.create_task(client.neighbour(fields, heavy, status))
        timing = await ordinary
    elif kind == "prefilling-3000":
        task = asyncio.create_task(client.neighbour(fields, heavy, status))
        await _until_running(client.client, heavy)
        timing = await client.ordinary(rng)
    else:
        task = asyncio.create_task(client.neighbour(fields, heavy, status))
        await heavy.wait()
        timing = await client.ordinary(rng)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return timing, status[0] if status else 0


async def _until_running(http: httpx.AsyncClient, refused: asyncio.Event) -> None:
    """Until the server runs a request (the neighbour's prefill is under way), or it was refused."""
    while not refused.is_set() and await _gauge(http, "nanoserve_requests_running") == 0:
        await asyncio.sleep(0.02)


async def _gauge(http: httpx.AsyncClient, name: str) -> float:
    text = (await http.get("/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def _settle(http: httpx.AsyncClient, timeout_s: float = 30.0) -> None:
    """Wait until the server runs and queues nothing (the cut neighbour's abort has landed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (await http.get("/metrics")).text
        busy = [line for line in text.splitlines()
                if line.startswith(("nanoserve_requests_running", "nanoserve_requests_waiting"))
                and float(line.split()[-1]) > 0]
        if not busy:
            return
        await asyncio.sleep(0.05)


async def run_neighbours(base_url: str, model: str, kinds: tuple[str, ...], turns: int, *,
                         seed: int = 0, api_key: str | None = None,
                         on_result: Callable[[NeighbourResult], None] | None = None) -> list[NeighbourResult]:
    """Every kind `turns` times (kinds interleaved within a turn, so drift spreads over all)."""
    for kind in kinds:
        neighbour_fields(kind, random.Random(0))  # an unknown kind fails before any request
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    results = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600, headers=headers,
                                 limits=httpx.Limits(max_connections=64)) as http:
        client = Client(http, model)
        await client.ordinary(rng)  # warm-up
        if "cached-context-4000" in kinds:
            await _warm_cached_context(client)
        for turn in range(turns):
            for kind in kinds:
                alone = await client.ordinary(rng)
                during, status = await _during(client, kind, rng)
                await _settle(http)
                after = await client.ordinary(rng)
                result = NeighbourResult(kind, turn, alone, during, after, status)
                results.append(result)
                if on_result is not None:
                    on_result(result)
    return results


async def _warm_cached_context(client: Client) -> None:
    heavy, status = asyncio.Event(), []
    fields = {"prompt": CACHED_CONTEXT, "max_tokens": 1, "temperature": 0.0}
    await client.neighbour(fields, heavy, status)


def median_ratios(results: list[NeighbourResult]) -> dict[str, float]:
    by_kind: dict[str, list[float]] = {}
    for result in results:
        by_kind.setdefault(result.kind, []).append(result.ratio)
    return {kind: statistics.median(ratios) for kind, ratios in by_kind.items()}
