"""What the routes drive: the one interface of the two engine bridges, and what a bridge sends.

Owns: `EngineBridge`, the base that `AsyncEngine` (one engine on a thread of this process,
async_engine.py) and `ReplicaPool` (data-parallel replicas, each a process, replicas.py) both
implement and the routes depend on: readiness and the 503 that says why a request cannot start
(`check_available`), the request checks (`admission`, the engine's `InputProcessor`), add /
abort / drain / stop, and the figures for /health and /metrics; `EngineUnavailableError`; the
commands a bridge hands the engine it drives (`AddSequence`, `AbortSequence`, and `EngineCall`,
the in-process engine's only), `apply_commands`, which runs them on the thread that steps the
engine (AsyncEngine's, or a replica's process), and `snapshot_of`, the engine's figures read there.
Refuses: HTTP; threads and processes (each bridge owns how it reaches its engines); and running
a function on an engine, which only `AsyncEngine.call` does, for the adapter routes (`build_app`
serves no adapters beside replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from nanoserve.server.metrics import EngineSnapshot

if TYPE_CHECKING:
    from nanoserve.engine.admission import InputProcessor
    from nanoserve.engine.core import Engine
    from nanoserve.model.lora import LoRARequest
    from nanoserve.multimodal.inputs import ImageInput
    from nanoserve.pooling_params import PoolingParams
    from nanoserve.sampling_params import SamplingParams


class EngineUnavailableError(RuntimeError):
    """The engine is still loading, has died, or is shutting down."""


@dataclass(frozen=True, slots=True)
class AddSequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    parent_id: str | None = None
    pooling: PoolingParams | None = None  # an embedding request
    lora_request: LoRARequest | None = None
    images: tuple[ImageInput, ...] = ()  # placed in prompt_ids by the planner


@dataclass(frozen=True, slots=True)
class AbortSequence:
    request_id: str


@dataclass(frozen=True, slots=True)
class EngineCall:
    """Run `run(engine)` between steps; `settle(result, error)` then hands the outcome to the
    event loop (AsyncEngine only: a replica's commands cross a process boundary)."""

    run: Callable[[Engine], object]
    settle: Callable[[object, BaseException | None], None]


Command = AddSequence | AbortSequence | EngineCall


class EngineBridge(ABC):
    """The event loop's side of the engines. Public methods run on the event loop."""

    died: ClassVar[str]  # what `check_available` says once the bridge is dead

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stopping = False
        self._draining = False
        self.engine: Engine | None = None  # the in-process engine; None while loading, or with replicas
        self.ready = False
        self.dead: BaseException | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    @abstractmethod
    def admission(self) -> InputProcessor | None:
        """The request checks every engine behind the bridge runs; None until ready."""

    @property
    @abstractmethod
    def max_running(self) -> int:
        """Sequences the engines behind the bridge run at once: the server queues only so many more."""

    @property
    @abstractmethod
    def healthy(self) -> bool: ...

    @property
    @abstractmethod
    def status(self) -> str: ...

    @abstractmethod
    def health_report(self) -> dict[str, object]:
        """/health's body; 200 when its status is "ok", else 503."""

    @property
    @abstractmethod
    def snapshot(self) -> EngineSnapshot:
        """The figures /metrics shows unlabelled."""

    @property
    @abstractmethod
    def replica_figures(self) -> tuple[tuple[EngineSnapshot, bool], ...]:
        """Each replica's figures and whether it is alive (none with one engine)."""

    @property
    @abstractmethod
    def num_in_flight(self) -> int:
        """Sequences handed to the engines and not yet finished or aborted."""

    def check_available(self) -> None:
        if self.dead is not None:
            raise EngineUnavailableError(f"{self.died}: {self.dead!r}")
        if self._stopping or self._draining:
            raise EngineUnavailableError("the server is shutting down")
        if not self.ready:
            raise EngineUnavailableError("the model is still loading")

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            queue: asyncio.Queue, *, parent_id: str | None = None,
            pooling: PoolingParams | None = None, images: tuple[ImageInput, ...] = ()) -> None:
        """Queue a sequence, one choice of the client request `parent_id` (with `pooling`, an
        embedding request; `images` placed in `prompt_ids`); its outputs (or an exception) arrive
        on `queue`."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a sequence (its reader is gone): no more outputs, its blocks freed at once."""

    def drain(self, deadline_s: float) -> None:
        """Refuse new work; what is still running after `deadline_s` fails with an error."""
        self._draining = True
        self._loop.call_later(deadline_s, self.cancel_all, EngineUnavailableError(
            f"the server is shutting down and the request did not finish within {deadline_s:g} s"))

    @abstractmethod
    def cancel_all(self, error: BaseException) -> None:
        """Fail every open sequence with `error` and abort it in its engine."""

    @abstractmethod
    def stop_now(self, error: BaseException) -> None:
        """A forced shutdown: fail every open sequence with `error` at once and stop the engines."""

    @abstractmethod
    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engines and wait for them (bounded); fail what is left."""

    def _call_soon(self, callback: Callable, *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is left to read
            self._loop.call_soon_threadsafe(callback, *args)


def apply_commands(engine: Engine, commands: list[Command]) -> list[tuple[str, BaseException]]:
    """Apply a batch of commands in order; the requests the engine refuses, with its error.
    (The server's checks ran before: a late refusal only fails that request.)"""
    rejected = []
    for command in commands:
        if isinstance(command, AbortSequence):
            engine.abort(command.request_id)
            continue
        if isinstance(command, EngineCall):
            try:
                result, error = command.run(engine), None
            except Exception as refused:  # the caller's to answer; the loop goes on
                result, error = None, refused
            command.settle(result, error)
            continue
        try:
            engine.add_request(command.prompt_ids, command.params, command.request_id,
                               parent_id=command.parent_id, pooling=command.pooling,
                               lora_request=command.lora_request, images=list(command.images) or None)
        except Exception as error:
            rejected.append((command.request_id, error))
    return rejected


def snapshot_of(engine: Engine) -> EngineSnapshot:
    """The engine's figures for /metrics, read on the thread that steps it."""
    pool, scheduler, stats = engine.pool, engine.scheduler, engine.stats
    return EngineSnapshot(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        kv_cache_usage=pool.usage,
        kv_free_blocks=pool.num_free_blocks,
        kv_total_blocks=pool.num_blocks,
        preemptions=scheduler.num_preemptions,
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens,
        steps=stats.steps,
        spec_draft_tokens=stats.spec_draft_tokens,
        spec_accepted_tokens=stats.spec_accepted_tokens,
    )
