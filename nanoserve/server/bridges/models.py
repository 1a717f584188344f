"""The models one server serves, each under its served name: `ModelRegistry`.

Owns: which models the server serves (`ModelSpec`: its names and how to build its engine),
finding a request's model by the name it sends, and each model's life (`ServedModel`): loaded on
its first request (the request waits; a load that fails answers the requests waiting for it with
the loader's message, and the next request tries again), held by leases (a request holds its
model from the moment the routes bind it until its response has ended, so a model is never
unloaded under a request), and unloaded when it has been idle for its keep-alive
(`ModelPolicy.idle_unload_s`, or what a request's `keep_alive` asked, Ollama's) or when loading
another would pass `ModelPolicy.max_loaded`: then the least recently used model with no lease
goes; with none idle the request waits up to `wait_timeout_s`, then fails naming why.
One model (`nanoserve serve --model M`) is the same registry with one pinned entry: built at
start, never unloaded, and its failure to load is the server's (`on_pinned_death`).
Each model is its own `EngineBridge` with its own engine and KV cache; the server's tenancy and
fair share sit above them all.
Refuses: HTTP (the routes bind a request and turn these errors into 404 / 503), the view one
request of a model reads (state.py builds it), and the engines themselves (each bridge owns its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.server.bridges.engine_bridge import EngineBridge, EngineUnavailableError

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig
    from nanoserve.engine.core import Engine

log = logging.getLogger("nanoserve.server")

# llama-server's --models-max default.
DEFAULT_MAX_LOADED = 4
# Ollama's default keep_alive: an idle model stays loaded this long.
DEFAULT_IDLE_UNLOAD_S = 300.0
DEFAULT_WAIT_TIMEOUT_S = 60.0


class ModelNotServedError(LookupError):
    """A request named a model this server does not serve (the routes answer 404)."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model the server serves. `names`: the first is its served name, all are listed;
    `aliases`: names it also answers to, unlisted (the path or hub id it was given as);
    `config`: what `build_engine` builds from, where known (serve's models), so the server can
    describe the model without loading it (Ollama's /api/tags and /api/show)."""

    names: tuple[str, ...]
    build_engine: Callable[[], Engine]
    aliases: tuple[str, ...] = ()
    config: EngineConfig | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def accepted(self) -> frozenset[str]:
        return frozenset((*self.names, *self.aliases))


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """When models load and unload (a pinned model ignores it: loaded at start, never unloaded)."""

    max_loaded: int = DEFAULT_MAX_LOADED
    idle_unload_s: float = DEFAULT_IDLE_UNLOAD_S  # inf: never
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S  # for a free slot, not for the load itself

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1; got {self.max_loaded}")
        if not self.idle_unload_s >= 0 or not self.wait_timeout_s >= 0:
            raise ValueError("idle_unload_s and wait_timeout_s must be >= 0")


@dataclass(eq=False, slots=True)
class ServedModel:
    """One model's life in the server. Event loop only."""

    spec: ModelSpec
    pinned: bool
    bridge: EngineBridge | None = None  # None: not loaded
    loading: asyncio.Future | None = None  # set while the bridge builds its engine
    leases: int = 0  # requests bound to it whose responses have not ended
    last_used_s: float = 0.0  # the event loop's clock when its last request ended
    keep_alive_s: float | None = None  # the last request's keep_alive, for this load; None: the policy's
    idle_timer: asyncio.TimerHandle | None = None
    # What state.py builds over this load for the requests of this model; dropped with the bridge.
    view: Any = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def status(self) -> str:
        """/v1/models' status: loaded, loading, or available (not loaded)."""
        if self.bridge is None:
            return "available"
        return "loaded" if self.bridge.ready and self.loading is None else "loading"


# Builds a model's bridge on the event loop: (spec, on_ready, on_death) -> bridge; the two
# callbacks run on the event loop.
BridgeFactory = Callable[[ModelSpec, Callable[[], None], Callable[[BaseException], None]], EngineBridge]


class ModelRegistry:
    """The served models by name, their loading, leases and unloading. Event loop only."""

    def __init__(self, specs: tuple[ModelSpec, ...], policy: ModelPolicy | None = None, *,
                 pinned: bool = False) -> None:
        """`pinned`: one model, loaded at start and never unloaded. Two models of one name
        (or alias) are a ValueError."""
        if not specs or (pinned and len(specs) != 1):
            raise ValueError("a server serves at least one model, and pins only its one model")
        self.specs = specs
        self.policy = policy or ModelPolicy()
        self.pinned = pinned
        served = [ServedModel(spec, pinned) for spec in specs]
        self._by_name: dict[str, ServedModel] = {}
        for model in served:
            for name in model.spec.accepted:
                if self._by_name.setdefault(name, model) is not model:
                    raise ValueError(f"two models are served as {name!r}")
        self.models = {model.name: model for model in served}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._make_bridge: BridgeFactory | None = None
        self._on_pinned_death: Callable[[BaseException], None] | None = None
        self._unloading = 0  # slots still held by models being unloaded
        self._changed: set[asyncio.Future] = set()  # requests waiting for a slot to free
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    # -- finding a model ------------------------------------------------------------------------

    @property
    def only(self) -> ServedModel | None:
        """The model a request that names none gets: the server's one model (None with several)."""
        return next(iter(self.models.values())) if len(self.models) == 1 else None

    def named(self, name: str) -> ServedModel | None:
        """The model served as `name` (one of its names or aliases), if any."""
        return self._by_name.get(name)

    def find(self, name: str | None) -> ServedModel:
        """The model `name` picks. With one model, every name gets it (its own checks then tell
        a LoRA adapter's name from an unknown one); with several, an unknown name is refused."""
        model = self._by_name.get(name) if name is not None else None
        if model is None:
            model = self.only
        if model is None:
            raise ModelNotServedError(
                f"the model {name!r} does not exist; this server serves {sorted(self.models)}" if name
                else f"this server serves several models: name one in `model` ({sorted(self.models)})")
        return model

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the registry has not started"
        return self._loop

    # -- start, leases ------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, make_bridge: BridgeFactory, *,
              on_pinned_death: Callable[[BaseException], None] | None = None) -> None:
        """Begin serving; a pinned model starts loading now."""
        self._loop, self._make_bridge, self._on_pinned_death = loop, make_bridge, on_pinned_death
        for model in self.models.values():
            if model.pinned:
                self._load(model)

    async def acquire(self, name: str | None) -> ServedModel:
        """A lease on the model `name` picks, loaded (a pinned model as it is: its bridge says
        whether it is ready). Raises `ModelNotServedError`, or `EngineUnavailableError` when it
        cannot load, no slot frees in time, or the server is shutting down. `release` it once."""
        model = self.find(name)
        if self._closed:
            raise EngineUnavailableError("the server is shutting down")
        model.leases += 1
        self._cancel_idle_timer(model)
        try:
            if not model.pinned:
                await self._until_loaded(model)
        except BaseException:
            self.release(model)
            raise
        return model

    def release(self, model: ServedModel) -> None:
        """A request of `model` has ended: once none is left, its keep-alive starts."""
        model.leases -= 1
        model.last_used_s = self.loop.time()
        if model.leases == 0:
            self._notify()
            self._schedule_idle_unload(model)

    def keep_alive(self, name: str, seconds: float | None) -> None:
        """Ollama's `keep_alive` for the model `name`: after its last request it stays loaded
        `seconds` (negative: until it must make room; 0: unloaded as soon as it is idle; None:
        the server's --idle-unload-s), until another request says otherwise or it unloads (as
        Ollama's, a keep-alive holds for one load: the next starts from the server's; one set
        while the model is not loaded holds for its next load)."""
        model = self.find(name)
        model.keep_alive_s = None if seconds is None else math.inf if seconds < 0 else float(seconds)
        if model.leases == 0:
            self._schedule_idle_unload(model)

    def unloads_in_s(self, model: ServedModel) -> float:
        """How long `model` stays loaded if no request comes: what is left of its idle time, or
        with requests in flight its whole keep-alive (it starts when the last ends); inf: until
        it must make room (or, pinned, for good)."""
        if model.pinned:
            return math.inf
        if model.idle_timer is not None:
            return max(0.0, model.idle_timer.when() - self.loop.time())
        return self._keep_alive_s(model)

    def _keep_alive_s(self, model: ServedModel) -> float:
        return self.policy.idle_unload_s if model.keep_alive_s is None else model.keep_alive_s

    # -- loading ------------------------------------------------------------------------------

    @property
    def num_loaded(self) -> int:
        """Slots in use: models loaded or loading, and models still being unloaded."""
        return sum(model.bridge is not None for model in self.models.values()) + self._unloading

    async def _until_loaded(self, model: ServedModel) -> None:
        deadline = self.loop.time() + self.policy.wait_timeout_s
        while True:
            if model.loading is not None:
                await asyncio.shield(model.loading)
                continue
            if model.bridge is not None:
                return
            if self._closed:
                raise EngineUnavailableError("the server is shutting down")
            if self.num_loaded < self.policy.max_loaded:
                self._load(model)
                continue
            victim = self._least_recently_used_idle()
            if victim is not None:
                await self._unload(victim, f"to make room for {model.name!r}")
                continue
            await self._wait_for_change(model, deadline)

    def _load(self, model: ServedModel) -> None:
        log.info("loading model %r", model.name)
        # A pinned model's requests do not wait for it: its bridge answers 503 while it loads.
        model.loading = None if model.pinned else self.loop.create_future()
        model.bridge = self._make_bridge(model.spec, lambda: self._loaded(model, None),
                                         lambda error: self._loaded(model, error))
        model.bridge.start()

    def _loaded(self, model: ServedModel, error: BaseException | None) -> None:
        """The bridge is ready or has died (while loading, or later)."""
        loading, model.loading = model.loading, None
        if error is None:
            log.info("model %r loaded", model.name)
            if loading is not None:
                loading.set_result(None)
            if model.leases == 0:  # every request that wanted it has gone meanwhile
                self._schedule_idle_unload(model)
            return
        if model.pinned:
            if self._on_pinned_death is not None:
                self._on_pinned_death(error)
            return
        log.error("model %r stopped: %s", model.name, error)
        if loading is not None:
            loading.set_exception(EngineUnavailableError(f"the model {model.name!r} failed to load: {error}"))
            loading.exception()  # read here: with no request waiting, nobody else would
        bridge = self._detach(model, "its engine stopped")  # the next request loads it again
        if bridge is not None:
            self._spawn(self._stop(bridge))

    def _least_recently_used_idle(self) -> ServedModel | None:
        idle = [m for m in self.models.values()
                if m.bridge is not None and m.loading is None and m.leases == 0 and not m.pinned]
        return min(idle, key=lambda m: m.last_used_s, default=None)

    async def _wait_for_change(self, model: ServedModel, deadline: float) -> None:
        remaining = deadline - self.loop.time()
        if remaining > 0:
            changed = self.loop.create_future()
            self._changed.add(changed)
            try:
                await asyncio.wait_for(changed, remaining)
                return
            except TimeoutError:
                pass
            finally:
                self._changed.discard(changed)
        raise EngineUnavailableError(
            f"the model {model.name!r} is not loaded and cannot be yet: {self.policy.max_loaded} models "
            f"are loaded (--max-loaded-models) and each has requests in flight; none finished within "
            f"{self.policy.wait_timeout_s:g} s (--model-wait-timeout-s)")

    def _notify(self) -> None:
        changed, self._changed = self._changed, set()
        for future in changed:
            if not future.done():
                future.set_result(None)

    # -- unloading ----------------------------------------------------------------------------

    def _schedule_idle_unload(self, model: ServedModel) -> None:
        self._cancel_idle_timer(model)
        keep_s = self._keep_alive_s(model)
        if model.pinned or model.bridge is None or math.isinf(keep_s) or self._closed:
            return
        model.idle_timer = self.loop.call_later(keep_s, self._unload_if_idle, model)

    def _cancel_idle_timer(self, model: ServedModel) -> None:
        if model.idle_timer is not None:
            model.idle_timer.cancel()
            model.idle_timer = None

    def _unload_if_idle(self, model: ServedModel) -> None:
        model.idle_timer = None
        if model.leases == 0 and model.bridge is not None and model.loading is None:
            self._spawn(self._unload(model, "idle"))

    async def _unload(self, model: ServedModel, reason: str) -> None:
        bridge = self._detach(model, reason)
        if bridge is not None:
            await self._stop(bridge)

    def _detach(self, model: ServedModel, reason: str) -> EngineBridge | None:
        """Take the model's bridge from it (its next request loads it again); its slot stays
        taken until `_stop` has freed its memory."""
        bridge, model.bridge, model.view = model.bridge, None, None
        if bridge is not None:
            self._cancel_idle_timer(model)
            model.keep_alive_s = None
            log.info("unloading model %r (%s)", model.name, reason)
            self._unloading += 1
        return bridge

    async def _stop(self, bridge: EngineBridge) -> None:
        try:
            await bridge.stop()
            await asyncio.to_thread(_free, bridge)
        finally:
            self._unloading -= 1
            self._notify()

    def _spawn(self, coroutine: Any) -> None:
        task = self.loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the server's shutdown and health -----------------------------------------------------

    @property
    def bridges(self) -> list[EngineBridge]:
        return [model.bridge for model in self.models.values() if model.bridge is not None]

    def drain(self, deadline_s: float) -> None:
        """Refuse new requests and loads; what runs gets `deadline_s` (each bridge's drain)."""
        self._close()
        for bridge in self.bridges:
            bridge.drain(deadline_s)

    def stop_now(self, error: BaseException) -> None:
        self._close()
        for bridge in self.bridges:
            bridge.stop_now(error)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._close()
        await asyncio.gather(*(bridge.stop(timeout_s) for bridge in self.bridges))
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task

    def _close(self) -> None:
        self._closed = True
        for model in self.models.values():
            self._cancel_idle_timer(model)
        self._notify()

    @property
    def healthy(self) -> bool:
        if self.pinned:
            return self.only.bridge.healthy
        return not self._closed

    def health_report(self) -> dict[str, object]:
        """/health's body: the pinned model's bridge's; with several models, "ok" while the
        server takes requests (a model that cannot load answers its own requests 503), and
        each model's status."""
        if self.pinned:
            return self.only.bridge.health_report()
        return {"status": "ok" if self.healthy else "draining",
                "models": {model.name: model.status for model in self.models.values()}}


def _free(bridge: EngineBridge) -> None:
    """Close the unloaded bridge's engine and give its memory back (the CUDA allocator keeps
    freed blocks cached, and the next model's KV budget is read from the free memory)."""
    engine, bridge.engine = bridge.engine, None
    if engine is not None:
        engine.close()
    del engine
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
