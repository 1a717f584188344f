"""Serving metrics for Prometheus, written with `prometheus_client` (one registry per app).

Owns: the latency histograms the request handlers observe (time to first token, inter-token
latency, end-to-end latency), finished-sequence counts, the per-tenant counts (sequences
finished, prompt and generated tokens, requests in flight, requests refused over the tenant's
limit: labelled by the tenant's name, never its key), and rendering them beside the engine's
own figures (running and waiting requests, KV cache usage, preemptions, token counters) taken
from the snapshot the engine thread publishes after every step. The names are vLLM's, with
`nanoserve_` for `vllm:`. With data-parallel replicas each engine figure is one series per
replica, labelled `replica` (its index), and no unlabelled one: Prometheus's `sum` adds them.
With several models, each model's engine figures are one series labelled with its name (zeros
and unhealthy while it is not loaded; a model loaded again starts its counters at zero, which
Prometheus reads as a counter reset).
Refuses: reading the engine directly; the engine is not thread-safe, the snapshot is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE", "EngineSnapshot", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort")


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
    """The app's metrics; observed and rendered on the event loop only."""

    def __init__(self, model_name: str, tenants: tuple[str, ...] = ()) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine = _EngineFigures(model_name)
        self.registry.register(self._engine)
        self.ttft = self._histogram("nanoserve_time_to_first_token_seconds",
                                    "Seconds from request arrival to its first output token.",
                                    LATENCY_BUCKETS_S)
        self.itl = self._histogram("nanoserve_inter_token_latency_seconds",
                                   "Seconds between two consecutive output tokens of a request.",
                                   ITL_BUCKETS_S)
        self.e2e = self._histogram("nanoserve_e2e_request_latency_seconds",
                                   "Seconds from request arrival to its last output token.",
                                   LATENCY_BUCKETS_S)
        self._finished = Counter("nanoserve_request_success", "Finished sequences, by finish reason.",
                                 ["model_name", "finished_reason"], registry=self.registry)
        tenant_labels = ["model_name", "tenant"]
        self._tenant_finished = Counter("nanoserve_tenant_request_success",
                                        "Finished sequences of each tenant (by name), by finish reason.",
                                        [*tenant_labels, "finished_reason"], registry=self.registry)
        self._tenant_prompt_tokens = Counter("nanoserve_tenant_prompt_tokens",
                                             "Prompt tokens of each tenant's finished requests.",
                                             tenant_labels, registry=self.registry)
        self._tenant_generation_tokens = Counter("nanoserve_tenant_generation_tokens",
                                                 "Tokens generated for each tenant.", tenant_labels,
                                                 registry=self.registry)
        self._tenant_rejected = Counter("nanoserve_tenant_requests_rejected",
                                        "Requests refused (429) over the tenant's concurrency limit.",
                                        tenant_labels, registry=self.registry)
        for reason in FINISH_REASONS:
            self._finished.labels(model_name, reason)
        self.add_tenants(tenants)

    def _histogram(self, name: str, help_: str, buckets: tuple[float, ...]):
        histogram = Histogram(name, help_, ["model_name"], buckets=buckets, registry=self.registry)
        return histogram.labels(self.model_name)

    def add_tenants(self, names: tuple[str, ...]) -> None:
        """Show every tenant from the start (at zero), not only once it has sent a request."""
        for name in names:
            for reason in FINISH_REASONS:
                self._tenant_finished.labels(self.model_name, name, reason)
            for counter in (self._tenant_prompt_tokens, self._tenant_generation_tokens,
                            self._tenant_rejected):
                counter.labels(self.model_name, name)
            self._engine.in_flight.setdefault(name, 0)

    def count_finished(self, reason: str, tenant: str | None) -> None:
        self._finished.labels(self.model_name, reason).inc()
        if tenant is not None:
            self._tenant_finished.labels(self.model_name, tenant, reason).inc()

    def count_tokens(self, tenant: str, prompt_tokens: int, generation_tokens: int) -> None:
        self._tenant_prompt_tokens.labels(self.model_name, tenant).inc(prompt_tokens)
        self._tenant_generation_tokens.labels(self.model_name, tenant).inc(generation_tokens)

    def count_rejected(self, tenant: str) -> None:
        self._tenant_rejected.labels(self.model_name, tenant).inc()

    def render(self, snapshot: EngineSnapshot, *, healthy: bool,
               in_flight: Mapping[str, int] | None = None,
               replicas: Sequence[tuple[EngineSnapshot, bool]] = (),
               models: Sequence[tuple[str, EngineSnapshot, bool]] = ()) -> bytes:
        """The exposition text: the engine's figures as of `snapshot`, each tenant's requests
        in flight as of `in_flight`, and everything observed so far. `replicas`: each
        data-parallel replica's (snapshot, healthy), shown instead of `snapshot`; `models`: each
        model's (name, snapshot, healthy) of a server of several, shown instead of it."""
        self._engine.snapshot, self._engine.healthy = snapshot, healthy
        self._engine.replicas = tuple(replicas)
        self._engine.models = tuple(models)
        self._engine.in_flight.update(in_flight or {})
        return generate_latest(self.registry)


class _EngineFigures:
    """A collector of the figures owned elsewhere: the engine's snapshot, and the requests each
    tenant has in flight (the tenancy counts them)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot = EngineSnapshot()
        self.healthy = False
        self.replicas: tuple[tuple[EngineSnapshot, bool], ...] = ()
        self.models: tuple[tuple[str, EngineSnapshot, bool], ...] = ()
        self.in_flight: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        if self.models:
            labels = ["model_name"]
            series = [([name], _engine_rows(snapshot, healthy)) for name, snapshot, healthy in self.models]
        elif self.replicas:
            labels = ["model_name", "replica"]
            series = [([self.model_name, str(i)], _engine_rows(snapshot, healthy))
                      for i, (snapshot, healthy) in enumerate(self.replicas)]
        else:
            labels, series = ["model_name"], [([self.model_name], _engine_rows(self.snapshot, self.healthy))]
        for index, (name, kind, help_, _) in enumerate(series[0][1]):
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_, labels=labels)
            for label_values, rows in series:
                family.add_metric(label_values, rows[index][3])
            yield family
        if self.in_flight:
            family = GaugeMetricFamily("nanoserve_tenant_requests_in_flight",
                                       "HTTP generation requests each tenant has in flight.",
                                       labels=["model_name", "tenant"])
            for tenant, count in sorted(self.in_flight.items()):
                family.add_metric([self.model_name, tenant], count)
            yield family


def _engine_rows(s: EngineSnapshot, healthy: bool) -> list[tuple[str, str, str, float]]:
    """(name, kind, help, value); a counter's name without the `_total` the format adds."""
    return [
        ("nanoserve_engine_healthy", "gauge", "1 while the engine loop runs, else 0.", int(healthy)),
        ("nanoserve_requests_running", "gauge", "Sequences in the engine's running batch.", s.running),
        ("nanoserve_requests_waiting", "gauge", "Sequences queued for admission.", s.waiting),
        ("nanoserve_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use (0 to 1).",
         s.kv_cache_usage),
        ("nanoserve_kv_cache_free_blocks", "gauge", "KV cache blocks free.", s.kv_free_blocks),
        ("nanoserve_kv_cache_total_blocks", "gauge", "KV cache blocks in the pool.", s.kv_total_blocks),
        ("nanoserve_num_preemptions", "counter", "Preemptions by recompute since start.", s.preemptions),
        ("nanoserve_prefix_cache_queries", "counter",
         "Tokens of admitted requests looked up in the prefix cache.", s.prefix_cache_queries),
        ("nanoserve_prefix_cache_hits", "counter",
         "Tokens of admitted requests the prefix cache supplied.", s.prefix_cache_hits),
        ("nanoserve_prompt_tokens", "counter", "Prompt tokens prefilled.", s.prompt_tokens),
        ("nanoserve_generation_tokens", "counter", "Tokens generated.", s.generation_tokens),
        ("nanoserve_engine_steps", "counter", "Engine steps run.", s.steps),
        ("nanoserve_spec_decode_draft_tokens", "counter", "Speculative draft tokens verified.",
         s.spec_draft_tokens),
        ("nanoserve_spec_decode_accepted_tokens", "counter",
         "Speculative draft tokens accepted (each equal to the token decoding would give).",
         s.spec_accepted_tokens),
    ]
