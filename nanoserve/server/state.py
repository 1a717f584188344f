"""What the app holds between requests: its limits, its engine and metrics, and the 503.

Owns: `ServerLimits` (what one request may ask for), `ServerState` (built once at startup,
reached from any request through `state_of`), `unavailable`, the one shape of "retry later"
(a 503 carrying Retry-After) that every module answers with, and `too_many_requests`, its 429
for a tenant over its own limit.
Refuses: behaviour; the modules that use the state decide what to do with it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from nanoserve.sampling_params import MAX_LOGPROBS
from nanoserve.server import protocol
from nanoserve.server.adapters import AdapterRegistry
from nanoserve.server.async_engine import AsyncEngine
from nanoserve.server.errors import APIError
from nanoserve.server.images import MediaPolicy
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.protocol import TokenText
from nanoserve.server.reasoning import ReasoningConfig
from nanoserve.server.tenants import Tenancy

if TYPE_CHECKING:
    from nanoserve.engine.core import Engine
    from nanoserve.server.replicas import ReplicaFront, ReplicaPool


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one request may ask for. Each bound keeps one caller from starving the rest."""

    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_tokens: int | None = None  # None: up to the context
    max_top_logprobs: int = MAX_LOGPROBS
    max_waiting: int = 256  # sequences queued beyond the engine's running batch
    retry_after_s: int = 1
    body_timeout_s: float = 30.0  # to send the whole body: a client that stalls is answered 408
    trust_request_chat_template: bool = False  # take a request's own chat_template (vLLM's flag)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where image URLs may be fetched from


@dataclass(slots=True)
class ServerState:
    async_engine: AsyncEngine | ReplicaPool  # one engine on a thread, or data-parallel replicas
    model_names: list[str]
    accepted_names: frozenset[str]
    tenancy: Tenancy  # the API keys, each a tenant, and what the server keeps apart between them
    limits: ServerLimits
    metrics: ServerMetrics
    created: int = field(default_factory=protocol.now_s)
    token_text: TokenText | None = None
    sse_keep_alive_s: float = 15.0  # a stream quiet this long gets a keep-alive comment
    default_seeds: random.Random | None = None  # `serve --seed`: seeds for requests that give none
    reasoning: ReasoningConfig = field(default_factory=ReasoningConfig)  # --reasoning-parser, -budget
    # The LoRA adapters a request's `model` may name (`build_app` gives the server's).
    adapters: AdapterRegistry = field(default_factory=lambda: AdapterRegistry(frozenset(), ""))

    def default_seed(self) -> int | None:
        """The next seed for a request that gives none; None: the engine picks a random one.

        Below 2**62, so the seeds of n choices (seed + i) stay below MAX_SEED."""
        return None if self.default_seeds is None else self.default_seeds.getrandbits(62)

    @property
    def engine(self) -> Engine | ReplicaFront:
        return self.async_engine.engine


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def unavailable(message: str, limits: ServerLimits) -> APIError:
    return APIError(503, message, code="service_unavailable",
                    headers={"Retry-After": str(limits.retry_after_s)})


def too_many_requests(message: str, limits: ServerLimits) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded",
                    headers={"Retry-After": str(limits.retry_after_s)})
