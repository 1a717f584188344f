"""The closed-loop driver every bench runs the engine with, and the one percentile definition.

Owns: keeping at most `slots` requests in flight on an `Engine` (each finished request is
replaced by the next waiting one before the next step, as a waiting client would), the clock
readings behind every latency figure (when a request was added, when each of its tokens
landed, when it finished) and each step's wall time, rows, kind and readbacks; and
`percentile` / `latency_ms`, the one definition of mean, median, std and p99 that the offline,
serve and syncbench figures share.
Refuses: building workloads, naming figures and printing (`offline`, `serve` and `profile` do).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.engine.core import Engine

Work = tuple[str | Sequence[int], SamplingParams]  # one request: its prompt and parameters


@dataclass(slots=True)
class RequestTimes:
    """One request's clock readings (time.perf_counter seconds) and token counts."""

    added_s: float
    token_s: list[float] = field(default_factory=list)  # when each step's token for it landed
    finished_s: float | None = None
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    @property
    def first_token_s(self) -> float | None:
        return self.token_s[0] if self.token_s else None

    @property
    def inter_token_s(self) -> list[float]:
        return [later - earlier for earlier, later in itertools.pairwise(self.token_s)]


@dataclass(slots=True)
class StepRecord:
    """One `Engine.step`: its wall time and what it did."""

    seconds: float
    rows: int  # requests that got a token
    is_decode: bool
    readbacks: int
    context_lens: list[int]  # each row's context length when its token was computed


@dataclass(slots=True)
class RunRecord:
    """Everything one timed run saw."""

    elapsed_s: float
    requests: list[RequestTimes]  # in the order they were added
    steps: list[StepRecord] = field(default_factory=list)
    peak_memory_mib: float = math.nan  # NaN unless the caller measured it
    spec_draft_tokens: int = 0  # speculative drafts verified in the run (0 unless the caller counted)
    spec_accepted_tokens: int = 0

    @property
    def output_digest(self) -> str:
        """SHA-256 of every request's token ids, in the order added: equal runs, equal digests."""
        return hashlib.sha256(repr([r.token_ids for r in self.requests]).encode()).hexdigest()[:16]

    @property
    def output_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def run_closed_loop(engine: Engine, work: Iterable[Work], slots: int, *,
                    on_step: Callable[[StepRecord], None] | None = None) -> RunRecord:
    """Every request of `work` to completion, in order, with at most `slots` in flight.

    `on_step` sees each step's record as soon as the step returns, before the finished
    requests are replaced (for callers that read their own counters per step).
    """
    waiting = list(work)[::-1]
    requests: dict[str, RequestTimes] = {}
    steps = []
    start = time.perf_counter()
    _admit(engine, waiting, slots, requests)
    while engine.has_unfinished():
        step, finished = _step(engine, requests)
        steps.append(step)
        if on_step is not None:
            on_step(step)
        _admit(engine, waiting, finished, requests)
    return RunRecord(time.perf_counter() - start, list(requests.values()), steps)


def _admit(engine: Engine, waiting: list[Work], count: int, requests: dict[str, RequestTimes]) -> None:
    for _ in range(min(count, len(waiting))):
        added_s = time.perf_counter()
        requests[engine.add_request(*waiting.pop())] = RequestTimes(added_s)


def _step(engine: Engine, requests: dict[str, RequestTimes]) -> tuple[StepRecord, int]:
    """Run one step; its record and how many requests it finished."""
    readbacks, decode_steps = engine.readbacks.count, engine.stats.decode_steps
    start = time.perf_counter()
    outputs = engine.step()
    now = time.perf_counter()
    for output in outputs:
        times = requests[output.request_id]
        times.token_s.append(now)
        times.num_tokens += len(output.token_ids)
        times.token_ids += output.token_ids
        times.num_prompt_tokens = output.num_prompt_tokens
        if output.finished:
            times.finished_s = now
    step = StepRecord(now - start, len(outputs), engine.stats.decode_steps > decode_steps,
                      engine.readbacks.count - readbacks,
                      [o.num_prompt_tokens + o.num_output_tokens - 1 for o in outputs])
    return step, sum(o.finished for o in outputs)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) by linear interpolation between the two closest ranks.

    This is numpy's default method ("linear", type 7 of Hyndman and Fan) and the one vLLM's
    `bench serve` reports; the 50th percentile is the median. NaN when there are no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100; got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


LATENCY_STATS = ("mean", "median", "std", "p99")


def latency_ms(values_s: Sequence[float]) -> dict[str, float]:
    """Mean, median, standard deviation (of the population) and p99 of `values_s`, in
    milliseconds, keyed by `LATENCY_STATS`; NaN each when there are no values."""
    ms = [1000 * value for value in values_s]
    if not ms:
        return dict.fromkeys(LATENCY_STATS, math.nan)
    return {"mean": statistics.fmean(ms), "median": percentile(ms, 50), "std": statistics.pstdev(ms),
            "p99": percentile(ms, 99)}
