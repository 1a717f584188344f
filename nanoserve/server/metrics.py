"""Serving metrics in the Prometheus text format (exposition 0.0.4), written by hand.

Owns: the latency histograms the request handlers observe (time to first token, inter-token
latency, end-to-end latency), finished-request counts, and rendering them beside the engine's
own figures (running and waiting requests, KV cache usage, preemptions, token counters) taken
from the snapshot the engine thread publishes after every step.
Refuses: reading the engine directly; the engine is not thread-safe, the snapshot is.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram; observed from the event loop only."""

    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.total!r}")
        lines.append(f"{self.name}_count{{{labels}}} {self.count}")
        return lines


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's figures after a step, published by the engine thread as one object."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self.ttft = Histogram("nanoserve_time_to_first_token_seconds",
                              "Seconds from request arrival to its first output token.", LATENCY_BUCKETS_S)
        self.itl = Histogram("nanoserve_inter_token_latency_seconds",
                             "Seconds between two consecutive output tokens of a request.", ITL_BUCKETS_S)
        self.e2e = Histogram("nanoserve_e2e_request_latency_seconds",
                             "Seconds from request arrival to its last output token.", LATENCY_BUCKETS_S)
        self.finished: Counter[str] = Counter()

    def render(self, snapshot: EngineSnapshot, *, healthy: bool) -> str:
        lines: list[str] = []
        for name, kind, help_, value in self._engine_rows(snapshot, healthy):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{self.labels}}} {value}"]
        lines += ["# HELP nanoserve_request_success_total Finished sequences, by finish reason.",
                  "# TYPE nanoserve_request_success_total counter"]
        for reason in ("stop", "length", "abort"):
            lines.append(f'nanoserve_request_success_total{{{self.labels},finished_reason="{reason}"}} '
                         f"{self.finished[reason]}")
        for histogram in (self.ttft, self.itl, self.e2e):
            lines += histogram.render(self.labels)
        return "\n".join(lines) + "\n"

    @staticmethod
    def _engine_rows(s: EngineSnapshot, healthy: bool) -> list[tuple[str, str, str, object]]:
        return [
            ("nanoserve_engine_healthy", "gauge", "1 while the engine loop runs, else 0.", int(healthy)),
            ("nanoserve_requests_running", "gauge", "Sequences in the engine's running batch.", s.running),
            ("nanoserve_requests_waiting", "gauge", "Sequences queued for admission.", s.waiting),
            ("nanoserve_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use (0 to 1).",
             repr(s.kv_cache_usage)),
            ("nanoserve_kv_cache_free_blocks", "gauge", "KV cache blocks free.", s.kv_free_blocks),
            ("nanoserve_kv_cache_total_blocks", "gauge", "KV cache blocks in the pool.", s.kv_total_blocks),
            ("nanoserve_num_preemptions_total", "counter", "Preemptions by recompute since start.",
             s.preemptions),
            ("nanoserve_prefix_cache_queries_total", "counter",
             "Tokens of admitted requests looked up in the prefix cache.", s.prefix_cache_queries),
            ("nanoserve_prefix_cache_hits_total", "counter",
             "Tokens of admitted requests the prefix cache supplied.", s.prefix_cache_hits),
            ("nanoserve_prompt_tokens_total", "counter", "Prompt tokens prefilled.", s.prompt_tokens),
            ("nanoserve_generation_tokens_total", "counter", "Tokens generated.", s.generation_tokens),
            ("nanoserve_engine_steps_total", "counter", "Engine steps run.", s.steps),
            ("nanoserve_spec_decode_draft_tokens_total", "counter",
             "Speculative draft tokens verified.", s.spec_draft_tokens),
            ("nanoserve_spec_decode_accepted_tokens_total", "counter",
             "Speculative draft tokens accepted (each equal to the token decoding would give).",
             s.spec_accepted_tokens),
        ]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
