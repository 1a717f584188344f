"""The hostile-client bench: what a server shared by clients who do not play nice gets wrong.

Owns five probes against one `nanoserve serve` process (the default model, a KV pool small
enough that a crowd preempts, two API keys as two tenants, LoRA's runtime routes on), each a
count of what went wrong, never a timing:
1. bad inputs: every POST operation the server documents (walked from its /openapi.json, so a
   new route is probed without a line here) gets seeded mutations of a valid body (one field
   swapped for a value of the wrong type, an edge number, a huge or nested value; a field
   dropped; an unknown field), adversarial JSON schemas where a route takes one, and raw bytes
   (broken JSON, NaN, a 5,000-digit integer, 30,000 nested arrays, bad UTF-8, an oversized
   body, the wrong content type). Each answer must come within a read timeout and not be a
   5xx, nor a 200 stream whose error event is a server error;
2. auth: every operation under /v1 and the tokenizer routes without a key, and with a wrong
   one (Bearer and x-api-key), must answer 401;
3. a crowd: greedy and seeded-sampling requests of both tenants at once (completions and chat,
   streamed and unary, n=2, logprobs, three long runners that outgrow the pool together), then
   each sent alone: tokens and logprobs must match bit for bit (DESIGN invariant 1), and
   /metrics must count preemptions, or the crowd proved nothing;
4. the prefix cache's side channel: tenant A sends a prompt holding a secret; tenant B guesses
   it; B's right guess must show no more `cached_tokens` than its wrong ones (A's own resend
   shows what B would see through a shared cache);
5. shutdown: SIGTERM during streams (each ends with its finish or an error event, then [DONE];
   the process exits 0), and on a second server a second SIGTERM during a long drain (it ends
   at once: the streams get their error event, the exit code is 143).
Writes one CSV (counts per probe and route, then a row per failure with the body that caused
it) with the machine's columns, and returns the summary the command prints.
`python -m nanoserve.bench.experiments.hostile --out results/hostile.csv`
Refuses: driving the engine in process (it is a client of a real server), and judging speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from nanoserve.bench.hardware import describe_machine
from nanoserve.bench.serve import launched_process, words

TENANTS = {"alice": "alice-0b7e5d2c", "bob": "bob-91f3a6e4"}
BODY_LIMIT_BYTES = 64 * 1024
DRAIN_S = 4.0
# 0.03 GB holds about 700 tokens of the default model's KV: two long runners outgrow it together.
SERVE_ARGS = ("--kv-cache-gb", "0.03", "--max-num-seqs", "16", "--max-tokens-limit", "128", "--max-n", "4",
              "--max-prompts", "4", "--max-body-bytes", str(BODY_LIMIT_BYTES), "--drain-s", str(DRAIN_S),
              "--enable-lora-runtime-updates", "--max-lora-rank", "8")
READ_TIMEOUT_S = 90.0  # a bad input's answer later than this is a hang
CONCURRENT_BAD_INPUTS = 8


@dataclass(slots=True)
class Tally:
    """Outcomes of one probe, by route, and the failures with what caused them."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (route, outcome) -> count
    failures: list[dict[str, str]] = field(default_factory=list)

    def add(self, route: str, outcome: str, *, failed: bool = False, case: str = "",
            detail: str = "") -> None:
        self.counts[route, outcome] += 1
        if failed:
            self.failures.append({"route": route, "outcome": outcome, "case": case, "detail": detail[:4000]})

    def total(self, outcome: str | None = None) -> int:
        return sum(n for (_, kind), n in self.counts.items() if outcome is None or kind == outcome)


def _headers(tenant: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANTS[tenant]}"}


# -- 1. bad inputs --------------------------------------------------------------------------------

def valid_bodies(model: str) -> dict[str, dict]:
    """A small valid body per known POST route (cheap to serve: a few tokens); a route not
    named here is probed from `{}`."""
    chat = [{"role": "user", "content": "Say one word."}]
    return {
        "/v1/completions": {"model": model, "prompt": "The sky is", "max_tokens": 4},
        "/v1/chat/completions": {"model": model, "messages": chat, "max_tokens": 4},
        "/v1/responses": {"model": model, "input": "Say one word.", "max_output_tokens": 4},
        "/v1/messages": {"model": model, "messages": chat, "max_tokens": 4},
        "/v1/embeddings": {"model": model, "input": "The sky is blue."},
        "/tokenize": {"model": model, "prompt": "The sky is blue."},
        "/detokenize": {"model": model, "tokens": [504, 6376, 314]},
        "/v1/load_lora_adapter": {"lora_name": "probe", "lora_path": "/nonexistent/adapter"},
        "/v1/unload_lora_adapter": {"lora_name": "probe"},
    }


# Fields a mutation may set beyond the body's own: the sampling and protocol fields of any route.
EXTRA_FIELDS = ("n", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "repetition_penalty",
                "max_tokens", "max_completion_tokens", "tools", "tool_choice", "response_format", "echo",
                "suffix", "best_of", "prompt_logprobs", "cache_salt", "priority", "system", "thinking",
                "instructions", "text", "encoding_format", "dimensions", "add_special_tokens",
                "chat_template", "lora_path", "lora_name", "input", "messages", "prompt", "tokens", "model")
HOSTILE_VALUES: tuple[object, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30), 1.5, -0.0, 1e-320,
    1.7976931348623157e308, -1e308, "", " ", "x" * 5000, "\u0000", "\ud800", "🚀" * 200, "-1", "1e999",
    "/", "/dev/zero", "/etc/passwd", "../../../../proc/self/environ",  # paths, for the LoRA routes
    [], [None], [[]], [-1], [2**40], ["a", 1, None], {}, {"": None}, {"-1": 1}, {"99999999": 100},
    [[[[[[[[[[[[1]]]]]]]]]]]], {"a": {"b": {"c": {"d": [1, {"e": None}]}}}}, list(range(3000)),
)
# Schemas a client may send for structured output or tool parameters that a naive grammar
# compiler could spend unbounded time or memory on.
HOSTILE_SCHEMAS: tuple[dict, ...] = (
    {"type": "string", "pattern": "(a|aa)*c"},
    {"type": "string", "pattern": "(x+x+)+y"},
    {"type": "string", "pattern": "["},
    {"type": "string", "minLength": 10**9},
    {"type": "array", "minItems": 10**8, "items": {"type": "integer"}},
    {"type": "integer", "minimum": 1e308, "maximum": -1e308},
    {"$ref": "#"},
    {"$ref": "#/definitions/missing"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"anyOf": [{"type": "string", "const": f"v{i}"} for i in range(500)]},
    {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(300)},
     "required": [f"k{i}" for i in range(300)]},
    {"type": ["string", 7]},
    {"enum": []},
    {"not": {}},
    {"type": "string", "format": "no-such-format"},
)


@dataclass(frozen=True, slots=True)
class Probe:
    """One request of the bad-input probe: raw bytes, or a JSON value to encode."""

    route: str
    case: str
    content: bytes
    content_type: str = "application/json"

    @classmethod
    def of_json(cls, route: str, case: str, value: object) -> Probe:
        return cls(route, case, json.dumps(value).encode())


def mutations(route: str, base: dict, rng: random.Random, count: int) -> Iterator[Probe]:
    """`count` seeded mutations of `base`: one field set to a hostile value, dropped, or nested
    one level deeper (in a message, a content part, a list item)."""
    for _ in range(count):
        body = json.loads(json.dumps(base))
        kind = rng.choice(("set", "set", "set", "drop", "unknown", "nested", "stream"))
        if kind == "drop" and body:
            key = rng.choice(sorted(body))
            del body[key]
            case = f"drop {key}"
        elif kind == "unknown":
            key = f"no_such_field_{rng.randrange(100)}"
            body[key] = rng.choice(HOSTILE_VALUES)
            case = f"unknown {key}"
        elif kind == "nested":
            case = _mutate_nested(body, rng)
        elif kind == "stream":  # a valid body streamed, plus one hostile field: the streaming path's checks
            key = rng.choice(EXTRA_FIELDS)
            body |= {"stream": True, key: rng.choice(HOSTILE_VALUES)}
            case = f"stream + {key}"
        else:
            key = rng.choice((*sorted(body), *EXTRA_FIELDS))
            body[key] = rng.choice(HOSTILE_VALUES)
            case = f"set {key}"
        yield Probe.of_json(route, case, body)


def _mutate_nested(body: dict, rng: random.Random) -> str:
    """Set one field inside the body's list of messages, prompts, tokens or inputs."""
    for key in ("messages", "input", "prompt", "tokens"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            inner = rng.choice(("role", "content", "tool_calls", "name", "type", "tool_call_id"))
            value[0][inner] = rng.choice((*HOSTILE_VALUES, [{"type": "image_url", "image_url": {"url": "x"}}],
                                          [{"type": "text", "text": None}], [{"type": "tool_use"}]))
            return f"nested {key}[0].{inner}"
        if key in body:
            body[key] = [rng.choice(HOSTILE_VALUES), value]
            return f"nested {key} as list"
    body["messages"] = [{"role": rng.choice(("user", "tool", "developer", "robot", "")),
                         "content": rng.choice(HOSTILE_VALUES)}]
    return "nested messages"


def schema_probes(route: str, base: dict) -> Iterator[Probe]:
    """Adversarial schemas in the place each protocol takes one."""
    for number, schema in enumerate(HOSTILE_SCHEMAS):
        case = f"schema {number}: {json.dumps(schema)[:60]}"
        if route == "/v1/chat/completions":
            fields: dict = {"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "s", "schema": schema}}}
        elif route == "/v1/responses":
            fields = {"text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}
        elif route == "/v1/messages":
            fields = {"tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}}
        else:
            return
        yield Probe.of_json(route, case, base | fields)


def raw_probes(route: str) -> Iterator[Probe]:
    """Bytes no JSON encoder writes."""
    cases = {
        "empty body": b"",
        "truncated JSON": b'{"model": "x", "prompt": "a',
        "trailing comma": b'{"prompt": "a",}',
        "NaN": b'{"prompt": "a", "temperature": NaN, "max_tokens": 4}',
        "Infinity": b'{"prompt": "a", "top_p": -Infinity, "max_tokens": 4}',
        "1e999": b'{"prompt": "a", "max_tokens": 1e999}',
        "5000-digit integer": b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
        "30000 nested arrays": b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}",
        "6000 nested objects": b'{"a":' * 6000 + b"1" + b"}" * 6000,
        "bad UTF-8": b'{"prompt": "\xff\xfe\xc0\xaf", "max_tokens": 4}',
        "lone surrogate escape": b'{"prompt": "\\ud800\\udbff", "max_tokens": 4}',
        "UTF-8 BOM": b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 4}',
        "duplicate keys": b'{"prompt": "a", "max_tokens": 4, "max_tokens": -5}',
        "JSON array": b"[1, 2, 3]",
        "JSON string": b'"hello"',
        "JSON null": b"null",
        "NUL bytes": b"\x00" * 64,
        "oversized body": b'{"prompt": "' + b"a" * (BODY_LIMIT_BYTES + 1024) + b'"}',
    }
    for case, content in cases.items():
        yield Probe(route, case, content)
    yield Probe(route, "text/plain content type", b'{"prompt": "a", "max_tokens": 4}', "text/plain")
    yield Probe(route, "form content type", b"prompt=a&max_tokens=4", "application/x-www-form-urlencoded")


async def post_routes(http: httpx.AsyncClient) -> list[str]:
    """Every POST path the server documents."""
    paths = (await http.get("/openapi.json")).json()["paths"]
    return sorted(path for path, operations in paths.items() if "post" in operations)


async def send_probe(http: httpx.AsyncClient, probe: Probe, tally: Tally) -> None:
    """One probe; its outcome counted: 2xx, 4xx, 5xx, hang (no answer within the read timeout,
    twice), no-answer (the connection closed), or a 200 stream whose error event is a server
    error. A probe that times out is sent once more before it counts as a hang: on a shared
    machine the whole run may be stopped for minutes (a neighbour's quiet measurement) and the
    wall clock runs on, while a real hang hangs again."""
    headers = _headers() | {"Content-Type": probe.content_type}
    detail = f"{probe.case}: {probe.content[:2000]!r}"
    for attempt in range(2):
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                async with http.stream("POST", probe.route, content=probe.content,
                                       headers=headers) as response:
                    text = (await response.aread()).decode(errors="replace")
            break
        except TimeoutError:
            if attempt == 1:
                tally.add(probe.route, "hang", failed=True, case=probe.case, detail=detail)
                return
        except httpx.TransportError as error:
            tally.add(probe.route, "no-answer", failed=True, case=probe.case, detail=f"{error!r}; {detail}")
            return
    status = response.status_code
    if status >= 500:
        tally.add(probe.route, "5xx", failed=True, case=probe.case, detail=f"{status} {text[:500]}; {detail}")
    elif status == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
        error = _server_error_event(text)
        if error:
            tally.add(probe.route, "stream-5xx", failed=True, case=probe.case, detail=f"{error}; {detail}")
        else:
            tally.add(probe.route, "2xx")
    else:
        tally.add(probe.route, f"{status // 100}xx")


SERVER_ERROR_TYPES = ("internal_server_error", "api_error")


def _server_error_event(text: str) -> str:
    """A streamed error that is the server's fault, in any of the three protocols' shapes
    (OpenAI's `internal_server_error`, Anthropic's `api_error`, Responses' `internal_error`
    code), or ''. A client error event is a clean refusal."""
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        error = event.get("error") if isinstance(event.get("error"), dict) else event
        if error.get("type") in SERVER_ERROR_TYPES or error.get("code") == "internal_error":
            return line[:500]
    return ""


async def probe_bad_inputs(http: httpx.AsyncClient, model: str, per_route: int, seed: int) -> Tally:
    bases = valid_bodies(model)
    probes: list[Probe] = []
    for route in await post_routes(http):
        base = bases.get(route, {})
        rng = random.Random(f"{seed}:{route}")
        probes += [*mutations(route, base, rng, per_route), *schema_probes(route, base), *raw_probes(route)]
    tally = Tally()
    limit = asyncio.Semaphore(CONCURRENT_BAD_INPUTS)

    async def one(probe: Probe) -> None:
        async with limit:
            await send_probe(http, probe, tally)

    await asyncio.gather(*(one(probe) for probe in probes))
    return tally


# -- 2. auth --------------------------------------------------------------------------------------

async def probe_auth(base_url: str, model: str) -> Tally:
    """Every guarded operation without a key and with wrong ones: each must be a 401."""
    tally = Tally()
    bases = valid_bodies(model)
    async with httpx.AsyncClient(base_url=base_url, timeout=READ_TIMEOUT_S) as http:
        paths = (await http.get("/openapi.json")).json()["paths"]
        for path, operations in sorted(paths.items()):
            if not (path.startswith("/v1") or path in ("/tokenize", "/detokenize")):
                continue
            url = path.replace("{model_id}", model)
            for method in operations:
                for case, headers in (("no key", {}), ("wrong bearer", {"Authorization": "Bearer wrong"}),
                                      ("wrong x-api-key", {"x-api-key": "wrong"}),
                                      ("other scheme", {"Authorization": f"Basic {TENANTS['alice']}"})):
                    body = bases.get(path) if method == "post" else None
                    response = await http.request(method.upper(), url, json=body, headers=headers)
                    ok = response.status_code == 401
                    tally.add(path, "401" if ok else str(response.status_code), failed=not ok,
                              case=f"{method.upper()} {case}", detail=response.text[:300])
    return tally


# -- 3. the crowd ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Call:
    index: int
    tenant: str
    path: str
    body: dict


def crowd_calls(num_clients: int, seed: int) -> list[Call]:
    """Both tenants; completions and chat; streamed and unary; greedy and seeded; n=2;
    logprobs; prompts of 8 to 120 words; then three long runners, any two of which outgrow
    the pool together, so the crowd preempts however its arrivals interleave."""
    rng = random.Random(seed)
    calls = []
    for i in range(num_clients):
        chat, stream, seeded = i % 3 == 1, (i // 2) % 2 == 0, (i // 4) % 2 == 1
        body: dict = {"max_tokens": 8 + 8 * (i % 8), "stream": stream, "ignore_eos": i % 6 == 0}
        body |= {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i} if seeded else {"temperature": 0.0}
        if i % 5 == 0:
            body["n"] = 2
        text = f"Note {i}. " + words(rng.randint(8, 120), rng)
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            if i % 2 == 0:
                body |= {"logprobs": True, "top_logprobs": 2}
        else:
            body["prompt"] = text
            if i % 2 == 0:
                body["logprobs"] = 2
        path = "/v1/chat/completions" if chat else "/v1/completions"
        calls.append(Call(i, ("alice", "bob")[i % 2], path, body))
    for j in range(3):
        body = {"prompt": f"Long note {j}. " + words(300, rng), "max_tokens": 128, "ignore_eos": True,
                "stream": j == 1, "logprobs": 1, **({"temperature": 0.8, "seed": 77} if j == 1 else
                                                   {"temperature": 0.0})}
        calls.append(Call(num_clients + j, ("alice", "bob")[j % 2], "/v1/completions", body))
    return calls


async def run_call(http: httpx.AsyncClient, model: str, call: Call) -> dict[int, dict]:
    """The call's choices by index: text, finish reason and every logprob entry, from the
    unary body or the stream's chunks alike (so the two compare)."""
    body = {"model": model, **call.body}
    choices: dict[int, dict] = {}
    if not call.body["stream"]:
        response = await http.post(call.path, json=body, headers=_headers(call.tenant))
        response.raise_for_status()
        for choice in response.json()["choices"]:
            _merge(choices, choice, chat=call.path.endswith("chat/completions"), delta=False)
        return choices
    async with http.stream("POST", call.path, json=body, headers=_headers(call.tenant)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            for choice in chunk.get("choices", []):
                _merge(choices, choice, chat=call.path.endswith("chat/completions"), delta=True)
    return choices


def _merge(choices: dict[int, dict], choice: dict, *, chat: bool, delta: bool) -> None:
    into = choices.setdefault(choice["index"], {"text": "", "logprobs": [], "finish_reason": None})
    if chat:
        message = choice.get("delta" if delta else "message") or {}
        into["text"] += message.get("content") or ""
    else:
        into["text"] += choice.get("text", "")
    logprobs = choice.get("logprobs") or {}
    if chat:
        into["logprobs"] += logprobs.get("content") or []
    elif logprobs:
        into["logprobs"] += list(zip(logprobs["tokens"], logprobs["token_logprobs"],
                                     logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"]),
                                     strict=True))
    into["finish_reason"] = choice.get("finish_reason") or into["finish_reason"]


async def counter(http: httpx.AsyncClient, name: str) -> float:
    text = (await http.get("/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def probe_crowd(http: httpx.AsyncClient, model: str, num_clients: int, seed: int
                      ) -> tuple[Tally, int]:
    """The crowd at once, then each call alone; a mismatch is cross-talk. Returns the tally and
    the preemptions the crowd caused."""
    calls = crowd_calls(num_clients, seed)
    before = await counter(http, "nanoserve_num_preemptions")
    crowd = await asyncio.gather(*(run_call(http, model, call) for call in calls), return_exceptions=True)
    preemptions = int(await counter(http, "nanoserve_num_preemptions") - before)
    tally = Tally()
    for call, in_crowd in zip(calls, crowd, strict=True):
        route = call.path + (" stream" if call.body["stream"] else "")
        if isinstance(in_crowd, BaseException):
            tally.add(route, "failed", failed=True, case=f"call {call.index}", detail=repr(in_crowd))
            continue
        alone = await run_call(http, model, call)
        same = alone == in_crowd
        tally.add(route, "match" if same else "mismatch", failed=not same, case=f"call {call.index}",
                  detail=f"{json.dumps(call.body)[:300]}; crowd {json.dumps(in_crowd)[:800]}; "
                         f"alone {json.dumps(alone)[:800]}")
    return tally, preemptions


# -- 4. the prefix cache's side channel -----------------------------------------------------------

async def cached_tokens(http: httpx.AsyncClient, model: str, tenant: str, prompt: str) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    response = await http.post("/v1/completions", json=body, headers=_headers(tenant))
    response.raise_for_status()
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def probe_side_channel(http: httpx.AsyncClient, model: str, trials: int, seed: int) -> Tally:
    """Per trial: alice sends a prompt with a 4-digit secret; bob sends a wrong guess (caching
    his own preamble), the right guess, and two more wrong ones. The channel is closed when
    the right guess shows no more cached tokens than the wrong ones after it (both: bob's own
    preamble) and his first request none; alice's resend shows what a shared cache would leak."""
    rng = random.Random(seed)
    tally = Tally()
    for trial in range(trials):
        preamble, tail = words(40, rng), words(40, rng)
        secret, *wrong = rng.sample(range(1000, 10000), 4)

        prompts = {code: f"{preamble} The door code is {code}. {tail}" for code in (secret, *wrong)}
        await cached_tokens(http, model, "alice", prompts[secret])
        first = await cached_tokens(http, model, "bob", prompts[wrong[0]])
        right = await cached_tokens(http, model, "bob", prompts[secret])
        later = [await cached_tokens(http, model, "bob", prompts[code]) for code in wrong[1:]]
        alice_again = await cached_tokens(http, model, "alice", prompts[secret])
        closed = first == 0 and right <= min(later)
        tally.add("/v1/completions", "closed" if closed else "open", failed=not closed, case=f"trial {trial}",
                  detail=f"bob's cached_tokens: first wrong {first}, right {right}, later wrong {later}; "
                         f"alice's resend {alice_again}")
        tally.add("/v1/completions",
                  f"trial {trial}: bob right {right} / wrong {later[0]}; alice {alice_again}")
    return tally


# -- 5. shutdown ----------------------------------------------------------------------------------

async def _stream_end(http: httpx.AsyncClient, model: str, index: int, started: asyncio.Event,
                      max_tokens: int) -> str:
    """One long stream: how it ended (finished, error event, cut without [DONE], refused)."""
    body = {"model": model, "prompt": f"Story {index}: once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    ended = "cut"
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=_headers()) as response:
            if response.status_code != 200:
                started.set()
                return f"refused {response.status_code}"
            async for line in response.aiter_lines():
                started.set()
                if line == "data: [DONE]":
                    return ended if ended != "cut" else "done without finish"
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        ended = "error event"
                    elif any(c.get("finish_reason") for c in chunk.get("choices", [])):
                        ended = "finished"
    except httpx.TransportError:
        pass
    return ended


async def _drain(base_url: str, process: subprocess.Popen, model: str, streams: int, *, second_signal: bool,
                 max_tokens: int, exit_within_s: float) -> Tally:
    tally = Tally()
    route = "second SIGTERM" if second_signal else "SIGTERM"
    async with httpx.AsyncClient(base_url=base_url, timeout=None) as http:
        started = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.create_task(_stream_end(http, model, i, started[i], max_tokens))
                 for i in range(streams)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), READ_TIMEOUT_S)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        if second_signal:
            await asyncio.sleep(1.0)
            process.send_signal(signal.SIGTERM)
        done, pending = await asyncio.wait(tasks, timeout=exit_within_s)
        for task in pending:
            task.cancel()
            tally.add(route, "stream hung", failed=True, detail=f"no end within {exit_within_s:g} s")
        for task in done:
            ended = task.result()
            tally.add(route, f"stream {ended}", failed=ended in ("cut", "done without finish"))
    remaining = max(1.0, exit_within_s - (time.monotonic() - signalled))
    try:
        code = await asyncio.to_thread(process.wait, remaining)
    except subprocess.TimeoutExpired:
        tally.add(route, "process hung", failed=True,
                  detail=f"still running {exit_within_s:g} s after SIGTERM")
        return tally
    expected = 128 + signal.SIGTERM if second_signal else 0
    tally.add(route, f"exit {code}", failed=code != expected, detail=f"expected exit {expected}")
    tally.add(route, f"exited after {time.monotonic() - signalled:.1f} s")
    return tally


# -- the whole run --------------------------------------------------------------------------------

@dataclass(slots=True)
class Report:
    bad_inputs: Tally
    auth: Tally
    crowd: Tally
    preemptions: int
    side_channel: Tally
    drain: Tally
    second_signal: Tally
    tracebacks: int  # in the servers' logs: a bug caught by a handler still leaves one
    logged_errors: Counter[str]  # the servers' ERROR lines by cause: for a reader, not judged

    def tallies(self) -> dict[str, Tally]:
        return {"bad-inputs": self.bad_inputs, "auth": self.auth, "crowd": self.crowd,
                "side-channel": self.side_channel, "drain": self.drain, "second-signal": self.second_signal}

    @property
    def failures(self) -> int:
        return (sum(len(t.failures) for t in self.tallies().values()) + (self.preemptions == 0)
                + self.tracebacks)

    def rows(self) -> list[dict[str, object]]:
        rows: list[dict[str, object]] = []
        for probe, tally in self.tallies().items():
            rows += [{"probe": probe, "route": route, "outcome": outcome, "count": count}
                     for (route, outcome), count in sorted(tally.counts.items())]
        rows.append({"probe": "crowd", "route": "/metrics", "outcome": "preemptions",
                     "count": self.preemptions})
        rows.append({"probe": "server-log", "outcome": "tracebacks", "count": self.tracebacks})
        rows += [{"probe": "server-log", "outcome": f"ERROR {message}", "count": count}
                 for message, count in sorted(self.logged_errors.items())]
        for probe, tally in self.tallies().items():
            rows += [{"probe": probe, "count": 1, "failed": True, **failure} for failure in tally.failures]
        return rows

    def summary(self) -> list[str]:
        bad, crowd = self.bad_inputs, self.crowd
        return [
            f"bad inputs: {bad.total()} over {len({r for r, _ in bad.counts})} POST routes: "
            f"{bad.total('2xx')} 2xx, {bad.total('4xx')} 4xx, {bad.total('5xx')} 5xx, "
            f"{bad.total('stream-5xx')} server-error stream events, {bad.total('hang')} hangs, "
            f"{bad.total('no-answer')} without an answer",
            f"auth: {self.auth.total('401')} of {self.auth.total()} unkeyed or wrongly keyed requests over "
            f"{len({r for r, _ in self.auth.counts})} guarded routes answered 401",
            f"crowd: {crowd.total('match')} of {crowd.total()} requests bit-identical alone, "
            f"{crowd.total('mismatch')} mismatches, {crowd.total('failed')} failed, "
            f"{self.preemptions} preemptions",
            f"prefix-cache side channel between two tenants: {self.side_channel.total('closed')} of "
            f"{self.side_channel.total('closed') + self.side_channel.total('open')} trials closed "
            f"({_side_channel_figures(self.side_channel)})",
            f"drain (SIGTERM): {_outcomes(self.drain)}",
            f"second SIGTERM: {_outcomes(self.second_signal)}",
            f"tracebacks in the server logs: {self.tracebacks}; ERROR lines: "
            f"{', '.join(f'{m} x{n}' for m, n in self.logged_errors.items()) or 'none'}",
            f"failures: {self.failures}",
        ]


def _outcomes(tally: Tally) -> str:
    return ", ".join(f"{outcome} x{count}" if count > 1 else outcome
                     for (_, outcome), count in sorted(tally.counts.items()))


def _side_channel_figures(tally: Tally) -> str:
    """The open trials' figures, or every trial's when all were closed."""
    if tally.failures:
        return "; ".join(failure["detail"] for failure in tally.failures)
    return "; ".join(outcome for (_, outcome) in tally.counts if outcome.startswith("trial"))


@contextlib.contextmanager
def keys_file() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="nanoserve-hostile-") as folder:
        path = Path(folder) / "keys"
        path.write_text("".join(f"{name} {key}\n" for name, key in TENANTS.items()))
        yield path


async def _first_server(base_url: str, process: subprocess.Popen, per_route: int, num_clients: int,
                        trials: int, seed: int) -> tuple[Tally, Tally, Tally, int, Tally, Tally]:
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(READ_TIMEOUT_S, read=None),
                                 limits=httpx.Limits(max_connections=128)) as http:
        model = (await http.get("/v1/models", headers=_headers())).json()["data"][0]["id"]
        auth = await probe_auth(base_url, model)
        bad_inputs = await probe_bad_inputs(http, model, per_route, seed)
        crowd, preemptions = await probe_crowd(http, model, num_clients, seed)
        side_channel = await probe_side_channel(http, model, trials, seed)
    drain = await _drain(base_url, process, model, 6, second_signal=False, max_tokens=128,
                         exit_within_s=DRAIN_S + 30)
    return bad_inputs, auth, crowd, preemptions, side_channel, drain


async def _second_server(base_url: str, process: subprocess.Popen) -> Tally:
    async with httpx.AsyncClient(base_url=base_url, timeout=READ_TIMEOUT_S) as http:
        model = (await http.get("/v1/models", headers=_headers())).json()["data"][0]["id"]
    return await _drain(base_url, process, model, 4, second_signal=True, max_tokens=128, exit_within_s=20)


def run(*, model: str | None, per_route: int, num_clients: int, trials: int, seed: int,
        log_dir: Path) -> Report:
    with keys_file() as keys:
        args = [*SERVE_ARGS, "--api-keys-file", str(keys), *(("--model", model) if model else ())]
        with launched_process(args, log_path=log_dir / "hostile_server.log") as (url, process):
            first = asyncio.run(_first_server(url, process, per_route, num_clients, trials, seed))
        # A drain long past the probe's patience: only the second signal can end it in time.
        args = [*args, "--drain-s", "600"]
        with launched_process(args, log_path=log_dir / "hostile_server_signals.log") as (url, process):
            second = asyncio.run(_second_server(url, process))
    logs = [path.read_text(errors="replace")
            for path in (log_dir / "hostile_server.log", log_dir / "hostile_server_signals.log")]
    tracebacks = sum(log.count("Traceback (most recent call last)") for log in logs)
    return Report(*first, second, tracebacks, _logged_errors(logs))


def _logged_errors(logs: list[str]) -> Counter[str]:
    """The ERROR lines by logger and the message's head, numbers as N, so one cause is one key:
    `... ERROR nanoserve: grammar refused token 75: parser error: ...` -> `nanoserve: grammar
    refused token N`."""
    heads = (": ".join(line.split(" ERROR ", 1)[1].split(": ")[:2])
             for log in logs for line in log.splitlines() if " ERROR " in line)
    return Counter(re.sub(r"\d+", "N", head) for head in heads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.experiments.hostile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--per-route", type=int, default=60, help="seeded mutations per POST route")
    parser.add_argument("--clients", type=int, default=48,
                        help="crowd requests beside the three long runners")
    parser.add_argument("--trials", type=int, default=4, help="side-channel secrets")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/hostile.csv"))
    args = parser.parse_args(argv)
    if min(args.per_route, args.clients, args.trials) < 1:
        parser.error("--per-route, --clients and --trials must be >= 1")
    report = run(model=args.model, per_route=args.per_route, num_clients=args.clients, trials=args.trials,
                 seed=args.seed, log_dir=args.out.parent)
    import pandas as pd

    machine = describe_machine("cpu").columns()
    columns = ["probe", "route", "outcome", "count", "failed", "case", "detail"]
    frame = pd.DataFrame(report.rows(), columns=columns)
    frame = frame.assign(failed=frame["failed"].eq(True), **machine)  # a count row has no verdict
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False)
    for line in report.summary():
        print(line)
    print(f"{machine['cpu_model']}, commit {machine['git_commit']}; wrote {args.out}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
