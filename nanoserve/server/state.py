"""What the app holds between requests: its limits, its models and metrics, and the 503.

Owns: `ServerLimits` (what one request may ask for), `ServerState` (the server's, built once at
startup; and, per loaded model, the same state bound to that model's engine, `for_model`, which
is what a request reads through `state_of` once the routes have bound it to its model; a
server of one model is its own bound state), `unavailable`, the one shape of "retry later"
(a 503 carrying Retry-After) that every module answers with, and `too_many_requests`, its 429
for a tenant over its own limit.
Refuses: behaviour; the modules that use the state decide what to do with it.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from nanoserve.sampling_params import MAX_LOGPROBS
from nanoserve.server.adapters import AdapterRegistry
from nanoserve.server.bridges.engine_bridge import EngineBridge
from nanoserve.server.bridges.models import ModelRegistry, ServedModel
from nanoserve.server.errors import APIError
from nanoserve.server.images import MediaPolicy
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.openai import protocol
from nanoserve.server.openai.protocol import TokenText
from nanoserve.server.parsers.reasoning import ReasoningConfig
from nanoserve.server.tenants import Tenancy

if TYPE_CHECKING:
    from nanoserve.engine.admission import InputProcessor
    from nanoserve.engine.core import Engine


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
    # The bridge of the model this state is bound to: `AsyncEngine` (one engine on a thread) or
    # `ReplicaPool` (replicas); None on the server's own state when it serves several models.
    async_engine: EngineBridge | None
    model_names: list[str]  # the bound model's listed names (several models: every served name)
    accepted_names: frozenset[str]
    tenancy: Tenancy  # the API keys, each a tenant, and what the server keeps apart between them
    limits: ServerLimits
    metrics: ServerMetrics
    created: int = field(default_factory=protocol.now_s)
    token_text: TokenText | None = None
    sse_keep_alive_s: float = 15.0  # a stream quiet this long gets a keep-alive comment
    default_seeds: random.Random | None = None  # `serve --seed`: seeds for requests that give none
    reasoning: ReasoningConfig = field(default_factory=ReasoningConfig)  # --reasoning-parser, -budget
    tool_call_parser: str = "auto"  # --tool-call-parser: a format of parsers.tool_formats, or auto
    # The LoRA adapters a request's `model` may name (`build_app` gives the server's).
    adapters: AdapterRegistry = field(default_factory=lambda: AdapterRegistry(frozenset(), ""))
    models: ModelRegistry | None = None  # every served model (`build_app` gives the server's)

    def for_model(self, model: ServedModel) -> ServerState:
        """This server as a request of `model` sees it: bound to the model's engine (built once
        per load of the model; the server's own state when it is that model's already)."""
        if model.bridge is self.async_engine:
            return self
        if model.view is None or model.view.async_engine is not model.bridge:
            spec = model.spec
            model.view = dataclasses.replace(
                self, async_engine=model.bridge, model_names=list(spec.names), accepted_names=spec.accepted,
                token_text=None, adapters=AdapterRegistry(spec.accepted, spec.name))
        return model.view

    def default_seed(self) -> int | None:
        """The next seed for a request that gives none; None: the engine picks a random one.

        Below 2**62, so the seeds of n choices (seed + i) stay below MAX_SEED."""
        return None if self.default_seeds is None else self.default_seeds.getrandbits(62)

    @property
    def admission(self) -> InputProcessor | None:
        """The request checks and the tokenizer of the engines serving; None while they load."""
        return self.async_engine.admission if self.async_engine is not None else None

    def image_refusal(self) -> str | None:
        """Why the model a request reaches takes no images (None: it does, or it is not up yet and
        the request is answered 503 later): a text-only model, or data-parallel replicas."""
        admission = self.admission
        if admission is None or admission.images is not None:
            return None
        if self.engine is None:  # the replicas' front, whose admission carries no image side
            return "images are not served with --data-parallel-size above 1 yet"
        return "this model takes no images (it has no vision tower)"

    @property
    def engine(self) -> Engine | None:
        """The in-process engine (None with replicas): the engine thread's alone, but for tests."""
        return self.async_engine.engine if self.async_engine is not None else None


def state_of(request: Request) -> ServerState:
    """What `request` reads: its model's state once the routes have bound it, else the server's."""
    return getattr(request.state, "model_state", None) or request.app.state.server


def unavailable(message: str, limits: ServerLimits) -> APIError:
    return APIError(503, message, code="service_unavailable",
                    headers={"Retry-After": str(limits.retry_after_s)})


def too_many_requests(message: str, limits: ServerLimits) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded",
                    headers={"Retry-After": str(limits.retry_after_s)})
