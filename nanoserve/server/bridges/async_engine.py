"""The engine loop thread: runs the synchronous `Engine` off the event loop.

Owns: one thread that builds the engine (so the server answers 503 while it loads) and then
steps it while there is work, sleeping on a condition when there is none (and logs how far a
prefill has got every `prefill_log_s` it keeps running, so a long prompt is visibly working); a command queue
(add, abort, call, stop) that is the only way the event loop touches the engine; per-request
`asyncio.Queue`s fed by one `loop.call_soon_threadsafe` per step; the health flag, cleared
if the loop dies, which fails every open stream; and the engine snapshot for /metrics.
It is one of the two `EngineBridge`s (engine_bridge.py), the one of a server without replicas.
Refuses: HTTP, and any engine call from the event loop thread (the engine is not thread-safe).
The only engine read allowed elsewhere is its `admission` (the request checks and the
tokenizer), which reads configuration only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from nanoserve.errors import NanoserveError
from nanoserve.server.bridges.engine_bridge import (
    AbortSequence,
    AddSequence,
    Command,
    EngineBridge,
    EngineCall,
    EngineUnavailableError,
    apply_commands,
    snapshot_of,
)
from nanoserve.server.metrics import EngineSnapshot

if TYPE_CHECKING:
    from nanoserve.engine.admission import InputProcessor
    from nanoserve.engine.core import Engine
    from nanoserve.engine.output import RequestOutput
    from nanoserve.model.lora import LoRARequest
    from nanoserve.multimodal.inputs import ImageInput
    from nanoserve.pooling_params import PoolingParams
    from nanoserve.sampling_params import SamplingParams

log = logging.getLogger("nanoserve.server")
PREFILL_LOG_S = 10.0  # a prefill still running after this long gets a progress line, then again


class AsyncEngine(EngineBridge):
    """Bridges the event loop and the engine thread. Public methods run on the event loop."""

    died = "the engine loop has died"

    def __init__(self, build_engine: Callable[[], Engine], loop: asyncio.AbstractEventLoop, *,
                 prefill_log_s: float = PREFILL_LOG_S,
                 on_ready: Callable[[], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        """`on_ready` runs on the event loop once the engine is built; `on_death` once the
        engine thread has died (a model that fails to load included), after every stream has
        been failed."""
        super().__init__(loop)
        self._build_engine = build_engine
        self._on_ready = on_ready
        self._on_death = on_death
        self._prefill_log_s = prefill_log_s
        self._prefill_logged_s: dict[str, float] = {}  # engine thread: when each prefill last logged
        self._arrivals: dict[str, float] = {}  # engine thread: arrival of each prefill logged
        self._commands: deque[Command] = deque()
        self._calls: set[asyncio.Future] = set()  # event loop only: `call`s not yet settled
        self._wake = threading.Condition()
        self._stop_start = threading.Event()  # set by `stop`: an engine still starting stops starting
        self._forced = False  # `stop_now`: the lifespan's stop waits for no step
        self._queues: dict[str, asyncio.Queue] = {}  # event loop only
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._snapshot = EngineSnapshot()

    # -- event loop side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def admission(self) -> InputProcessor | None:
        return self.engine.admission if self.engine is not None else None

    @property
    def max_running(self) -> int:
        return self.engine.config.max_num_seqs

    @property
    def healthy(self) -> bool:
        return (self.ready and self.dead is None and self._thread.is_alive() and not self._stopping
                and not self._draining)

    @property
    def status(self) -> str:
        if self.healthy:
            return "ok"
        if self.dead is not None or (self.ready and not self._thread.is_alive()):
            return "dead"
        return "loading" if not self.ready else "draining"

    def health_report(self) -> dict[str, object]:
        return {"status": self.status}

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's figures as of its last step."""
        return self._snapshot

    @property
    def replica_figures(self) -> tuple[tuple[EngineSnapshot, bool], ...]:
        """One engine, no replicas: /metrics shows `snapshot` unlabelled."""
        return ()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            queue: asyncio.Queue, *, parent_id: str | None = None,
            pooling: PoolingParams | None = None, lora_request: LoRARequest | None = None,
            images: tuple[ImageInput, ...] = ()) -> None:
        """Queue a sequence, one choice of the client request `parent_id` (with `pooling`, an
        embedding request; with `lora_request`, run with that adapter, resident already; with
        `images`, those placed in its prompt); its outputs (or an exception) arrive on `queue`."""
        self.check_available()
        self._queues[request_id] = queue
        self._send(AddSequence(request_id, prompt_ids, params, parent_id, pooling, lora_request, images))

    async def call(self, run: Callable[[Engine], object], *,
                   then: Callable[[object], None] | None = None) -> object:
        """`run(engine)` on the engine thread, between steps; its result, or its exception raised
        here. `then(result)` runs on the event loop when it succeeds, even if the awaiting task
        was cancelled meanwhile (the engine's change is made either way)."""
        self.check_available()
        future = self._loop.create_future()
        if then is not None:
            future.add_done_callback(lambda done: then(done.result())
                                     if not done.cancelled() and done.exception() is None else None)
        self._calls.add(future)
        self._send(EngineCall(run, lambda result, error: self._call_soon(
            self._settle, future, result, error)))
        return await asyncio.shield(future)

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._send(AbortSequence(request_id))

    def cancel_all(self, error: BaseException) -> None:
        request_ids = list(self._queues)
        self._fail_all(error)
        for request_id in request_ids:
            self._send(AbortSequence(request_id))

    def stop_now(self, error: BaseException) -> None:
        """A forced shutdown: fail every open sequence with `error` at once and tell the thread
        to stop; `stop` then waits for no step (the thread is a daemon, so a long prefill it is
        still computing dies with the process)."""
        self._draining = self._forced = True
        self.cancel_all(error)
        with self._wake:
            self._stopping = True
            self._wake.notify()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it (not at all once forced): within
        `timeout_s` once the engine runs; while it still starts, until the thread has left (its
        start is called off at its next phase, `engine.executor.stoppable_start`), as a thread
        still inside torch when the interpreter finalizes aborts the process."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._stop_start.set()
        deadline = time.monotonic() + timeout_s
        while (self._thread.is_alive() and not self._forced
               and (not self.ready or time.monotonic() < deadline)):
            await asyncio.to_thread(self._thread.join, 0.1)
        self._fail_all(EngineUnavailableError("the server shut down before the request finished"))

    def _send(self, command: Command) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _deliver(self, outputs: list[RequestOutput | tuple[str, BaseException]]) -> None:
        for item in outputs:
            if isinstance(item, tuple):
                queue = self._queues.pop(item[0], None)
                if queue is not None:
                    queue.put_nowait(item[1])
                continue
            queue = self._queues.get(item.request_id)
            if queue is None:
                continue  # aborted by its reader while this step ran
            if item.finished:
                del self._queues[item.request_id]
            queue.put_nowait(item)

    def _fail_all(self, error: BaseException) -> None:
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(error)
        for future in list(self._calls):
            self._settle(future, None, error)

    def _settle(self, future: asyncio.Future, result: object, error: BaseException | None) -> None:
        self._calls.discard(future)
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # -- engine thread side -------------------------------------------------------------------

    def _run(self) -> None:
        from nanoserve.engine.executor import StartCancelled, stoppable_start

        try:
            with stoppable_start(self._stop_start):
                self.engine = self._build_engine()
            self._publish_snapshot()
            self.ready = True
            log.info("engine ready")
            if self._on_ready is not None:
                self._call_soon(self._on_ready)
            while self._loop_once():
                pass
            self._abort_all()
            self.engine.close()  # the prefix cache's directory gets its blocks
        except StartCancelled as error:  # told to stop while it loaded: no death, nothing to report
            log.info("the engine stopped before it was ready: %s", error)
        except BaseException as error:  # the loop is dead: say so, fail every stream
            if isinstance(error, NanoserveError):  # a model that cannot load: its message is the news
                log.error("the engine stopped: %s", error)
            else:
                log.exception("the engine loop died")
            self.dead = error
            self._call_soon(self._fail_all, EngineUnavailableError(f"the engine loop died: {error!r}"))
            if self._on_death is not None:
                self._call_soon(self._on_death, error)

    def _loop_once(self) -> bool:
        """Apply pending commands, run one step if there is work; False once told to stop."""
        engine = self.engine
        with self._wake:
            while not self._commands and not engine.has_unfinished() and not self._stopping:
                self._wake.wait()
            commands = list(self._commands)
            self._commands.clear()
            stopping = self._stopping
        if stopping:
            return False
        delivered: list[RequestOutput | tuple[str, BaseException]] = apply_commands(engine, commands)
        if engine.has_unfinished():
            outputs = engine.step()
            self._log_long_prefills(outputs)
            delivered += outputs
        self._publish_snapshot()
        if delivered:
            self._call_soon(self._deliver, delivered)
        return True

    def _log_long_prefills(self, outputs: list[RequestOutput]) -> None:
        """A line per prefill that has run `prefill_log_s` since its request arrived (or since
        its last line), and one when such a prefill is done (its first token came out)."""
        now = time.monotonic()
        logged, self._prefill_logged_s = self._prefill_logged_s, {}
        for output in outputs:
            if output.request_id in logged and output.num_output_tokens == 1:
                log.info("request %s: prefill of %d prompt tokens done in %.1f s", output.request_id,
                         output.num_prompt_tokens, now - self._arrivals.pop(output.request_id, now))
        for request in self.engine.scheduler.running:
            done, total = request.num_computed_tokens, len(request.prompt_ids)
            if done >= total:
                continue
            last = logged.get(request.request_id, request.arrival_s)
            if now - last >= self._prefill_log_s:
                log.info("request %s: prefilled %d of %d prompt tokens (%.0f%%) in %.1f s",
                         request.request_id, done, total, 100 * done / total, now - request.arrival_s)
                self._arrivals[request.request_id] = request.arrival_s
                last = now
            if request.request_id in self._arrivals:
                self._prefill_logged_s[request.request_id] = last
        for request_id in set(self._arrivals) - set(self._prefill_logged_s):
            del self._arrivals[request_id]  # finished or aborted before its prefill was done

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        self._publish_snapshot()

    def _publish_snapshot(self) -> None:
        self._snapshot = snapshot_of(self.engine)

