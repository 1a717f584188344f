"""Data-parallel replicas: N engines, each in its own process on its own cores, behind one server.

Owns: `ReplicaPlan` (N, the engine configuration every replica runs, the checks that can fail
before a process starts, each replica's share of the cores); the replica process
(`run_replica`: builds its engine, then applies commands and steps while there is work); the
protocol between it and the server, one duplex pipe a replica (server to replica: `AddSequence`,
`AbortSequence`, or None to stop; replica to server: ("ready", `ReplicaReady`), ("failed", error),
or ("step", outputs and refusals, its `EngineSnapshot`) after every step); routing; and
`ReplicaPool`, the `EngineBridge` (engine_bridge.py) of a server with replicas, which the routes
drive exactly as they drive `AsyncEngine` (add, abort, drain, stop, health, figures). Its
`admission` is the engines' own `InputProcessor`, built from the facts replica 0 reports, so a
request is refused with the very message a single engine gives, before any replica sees it.
Routing: the sequences of one client request (its `parent_id`) go where its first went, so the
fair share still sees them together; otherwise the replica whose prefix cache most likely holds
the longest run of the prompt's leading blocks, keyed as the block pool keys them (the request's
`cache_salt` and, in `tenant` scope, its tenant's salt, in the chain), else the one with the
fewest sequences in flight. The server keeps each replica's keys as it sends prompts there (at
most the replica's pool size, least recently sent dropped first): a guess, since a replica may
have evicted a block, which costs a recompute, never a wrong token.
Start-up: replica 0 builds first and the others take its linear kernel, so every replica runs the
kernel one measurement chose and a request's tokens do not depend on the replica serving it.
Faults: a replica that exits is reported (/health answers 503 naming it, /metrics shows it
unhealthy), its in-flight sequences fail with an error naming it, and the others keep serving;
a replica that fails while starting stops the server, as a model that cannot load does; the
replicas exit when the server stops or dies (their pipe closes).
With N = 1 there is no pool: the server runs `AsyncEngine`'s thread in its own process.
Refuses: replicas on CUDA, replicas under torchrun, and more ranks (replicas x tensor-parallel
ranks) than cores unless --threads says how many each gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue as queues
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.distributed.group import cores, local_ranks
from nanoserve.engine.admission import InputProcessor
from nanoserve.engine.block_pool import block_keys, chain_root
from nanoserve.engine.core import Engine
from nanoserve.engine.structured import GrammarCompiler
from nanoserve.errors import InvalidRequestError
from nanoserve.server.bridges.engine_bridge import (
    AbortSequence,
    AddSequence,
    EngineBridge,
    EngineUnavailableError,
    apply_commands,
    snapshot_of,
)
from nanoserve.server.metrics import EngineSnapshot
from nanoserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from nanoserve.engine.output import RequestOutput
    from nanoserve.multimodal.inputs import ImageInput
    from nanoserve.pooling_params import PoolingParams
    from nanoserve.sampling_params import SamplingParams

log = logging.getLogger("nanoserve.server")
OPTION = "data_parallel_size"
STOP_JOIN_S = 10.0  # a replica told to stop that is still running after this is killed


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """`size` replicas, each an engine of `config`."""

    config: EngineConfig
    size: int

    def check(self) -> None:
        """Everything that can fail before a replica starts, naming the option."""
        if self.size < 1:
            raise InvalidRequestError(f"data_parallel_size must be at least 1; got {self.size}", param=OPTION)
        if self.size > 1 and ("RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ):
            raise InvalidRequestError("data_parallel_size > 1 does not run under torchrun: start one "
                                      "server a node, each with its own replicas", param=OPTION)
        device = self.config.device or ""
        if device.startswith("cuda"):
            raise InvalidRequestError("data-parallel replicas run on the CPU; on CUDA start one server "
                                      "a GPU behind a load balancer", param=OPTION)
        ranks = self.size * local_ranks(self.config)
        if self.config.threads is None and ranks > cores():
            raise InvalidRequestError(
                f"data_parallel_size {self.size} x tensor_parallel_size {local_ranks(self.config)} is "
                f"{ranks} ranks, more than this machine's {cores()} cores, which would leave a replica "
                "with no core of its own; pass --threads 1 to run them anyway, sharing cores", param=OPTION)

    def cpu_sets(self) -> list[tuple[int, ...] | None]:
        """Each replica's cores: the usable cores split in contiguous runs, the remainder to the
        first ones; None for every replica (no pinning) when there are fewer cores than replicas."""
        usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
        if len(usable) < self.size:
            return [None] * self.size
        share, extra = divmod(len(usable), self.size)
        sets, start = [], 0
        for index in range(self.size):
            count = share + (index < extra)
            sets.append(tuple(usable[start:start + count]))
            start += count
        return sets


@dataclass(frozen=True, slots=True)
class ReplicaReady:
    """What a replica says once its engine is built: what the server needs to check requests."""

    model_dir: str
    model_config: ModelConfig
    vocab_size: int
    max_model_len: int
    num_blocks: int
    linear_kernel: str
    kernel_summary: str
    pooling_method: str = "last"  # an embedding request's method when it names none (the engine's)


# ---- the replica process ----------------------------------------------------------------------


def run_replica(config: EngineConfig, cpus: tuple[int, ...] | None, conn: Connection) -> None:
    """A replica's process: build the engine, say so, then serve the pipe until told to stop or
    until the server's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains us
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        engine = Engine(config)
    except BaseException as error:
        conn.send(("failed", _picklable(error)))
        return
    conn.send(("ready", ReplicaReady(str(engine.model_dir), engine.model_config, engine.vocab_size,
                                     engine.max_model_len,
                                     engine.pool.num_blocks, engine.kernel_choice.kernel.name,
                                     engine.kernel_summary, engine.pooling_method)))
    try:
        _serve(engine, conn)
    except (EOFError, BrokenPipeError):
        pass  # the server is gone: nobody is left to answer
    finally:
        engine.close()


def _serve(engine: Engine, conn: Connection) -> None:
    while True:
        commands = [] if engine.has_unfinished() else [conn.recv()]  # idle: wait to be told
        while conn.poll():
            commands.append(conn.recv())
        if None in commands:
            return
        delivered: list = apply_commands(engine, commands)
        if engine.has_unfinished():
            delivered += engine.step()
        conn.send(("step", delivered, snapshot_of(engine)))


def _picklable(error: BaseException) -> BaseException:
    """The error itself when it crosses the pipe intact (a NanoserveError then stops the server
    naming its cause), else its repr."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(repr(error))
    return error


# ---- the server's side -----------------------------------------------------------------------


def replica_admission(config: EngineConfig, ready: ReplicaReady) -> InputProcessor:
    """The admission every replica runs (each replica's engine of `config` reported `ready`),
    built in the server to check requests before any replica sees them."""
    tokenizer = Tokenizer.from_dir(Path(ready.model_dir))
    grammars = GrammarCompiler(tokenizer.backend.to_str(), vocab_size=ready.vocab_size,
                               eos_token_ids=tokenizer.eos_token_ids)
    return InputProcessor(tokenizer, grammars, vocab_size=ready.vocab_size, max_model_len=ready.max_model_len,
                          num_blocks=ready.num_blocks, block_size=config.block_size, task=config.task,
                          pooling_method=ready.pooling_method, hidden_size=ready.model_config.hidden_size,
                          tensor_parallel=config.tensor_parallel_size > 1)


@dataclass(eq=False)
class Replica:
    index: int
    cpus: tuple[int, ...] | None
    process: multiprocessing.process.BaseProcess | None = None
    conn: Connection | None = None
    outbox: queues.SimpleQueue = field(default_factory=queues.SimpleQueue)
    started: threading.Event = field(default_factory=threading.Event)  # ready, or failed to start
    ready: ReplicaReady | None = None
    failure: BaseException | None = None  # what it sent before exiting, if anything
    exit_reason: str | None = None  # set once its process has exited
    snapshot: EngineSnapshot = field(default_factory=EngineSnapshot)
    in_flight: int = 0  # sequences routed here and not finished (event loop only)
    cached: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # block keys sent here

    @property
    def alive(self) -> bool:
        return self.ready is not None and self.exit_reason is None

    @property
    def name(self) -> str:
        return f"data-parallel replica {self.index}"


@dataclass(slots=True)
class _Route:
    queue: asyncio.Queue
    replica: Replica
    parent_id: str | None


class ReplicaPool(EngineBridge):
    """N replicas behind the server, driven as `AsyncEngine` is. Public methods run on the event
    loop; one thread starts the replicas, and each replica has a thread that writes its pipe and
    one that reads it."""

    died = "every data-parallel replica has stopped"

    def __init__(self, plan: ReplicaPlan, loop: asyncio.AbstractEventLoop, *,
                 check_engine: Callable[[InputProcessor], None] = lambda admission: None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        """`check_engine` runs once on the replicas' `admission`, after every replica is ready (a
        failure stops the server as a model that cannot load does); `on_death` runs on the event
        loop if the pool dies (a replica fails to start, or every replica has exited)."""
        super().__init__(loop)
        self.plan = plan
        self._check_engine = check_engine
        self._on_death = on_death
        self._context = multiprocessing.get_context("spawn")  # a fork would copy the server's threads
        self.replicas = [Replica(index, cpus) for index, cpus in enumerate(plan.cpu_sets())]
        self._routes: dict[str, _Route] = {}  # event loop only
        self._parents: dict[str, tuple[Replica, int]] = {}  # parent id -> its replica, sequences there
        self._starter = threading.Thread(target=self._start_replicas, name="nanoserve-replicas", daemon=True)
        self._admission: InputProcessor | None = None

    # -- what the server reads ------------------------------------------------------------------

    @property
    def admission(self) -> InputProcessor | None:
        return self._admission

    @property
    def max_running(self) -> int:
        """The running batches of every replica."""
        return self.plan.config.max_num_seqs * self.plan.size

    @property
    def healthy(self) -> bool:
        return (self.ready and self.dead is None and not self._stopping and not self._draining
                and all(r.alive for r in self.replicas))

    @property
    def status(self) -> str:
        if self.healthy:
            return "ok"
        if self.dead is not None:
            return "dead"
        if not self.ready:
            return "loading"
        if self._stopping or self._draining:
            return "draining"
        return "degraded"  # a replica has exited; the others serve

    def health_report(self) -> dict[str, object]:
        """The pool's status and each replica's (an exited one with its exit)."""
        replicas = []
        for replica in self.replicas:
            entry: dict[str, object] = {"replica": replica.index, "status": (
                "dead" if replica.exit_reason is not None else "ok" if replica.ready else "loading")}
            if replica.exit_reason is not None:
                entry["error"] = f"{replica.name} {replica.exit_reason}"
            replicas.append(entry)
        return {"status": self.status, "replicas": replicas}

    @property
    def replica_figures(self) -> tuple[tuple[EngineSnapshot, bool], ...]:
        return tuple((r.snapshot, r.alive) for r in self.replicas)

    @property
    def snapshot(self) -> EngineSnapshot:
        """Every live replica's figures added up (usage: of all their blocks)."""
        live = [r.snapshot for r in self.replicas if r.alive]
        total = {f.name: sum(getattr(s, f.name) for s in live) for f in dataclasses.fields(EngineSnapshot)}
        blocks = total["kv_total_blocks"]
        total["kv_cache_usage"] = (blocks - total["kv_free_blocks"]) / blocks if blocks else 0.0
        return EngineSnapshot(**total)

    @property
    def num_in_flight(self) -> int:
        return len(self._routes)

    # -- requests -------------------------------------------------------------------------------

    def start(self) -> None:
        self._starter.start()

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            queue: asyncio.Queue, *, parent_id: str | None = None,
            pooling: PoolingParams | None = None, images: tuple[ImageInput, ...] = ()) -> None:
        """Route a sequence (with `pooling`, an embedding request) to a replica and queue it
        there; its outputs arrive on `queue`. (`images`: the planner refuses them beside replicas.)"""
        self.check_available()
        replica = self._route(prompt_ids, params, parent_id)
        self._routes[request_id] = _Route(queue, replica, parent_id)
        replica.in_flight += 1
        if parent_id is not None:
            _, count = self._parents.get(parent_id, (replica, 0))
            self._parents[parent_id] = (replica, count + 1)
        replica.outbox.put(AddSequence(request_id, prompt_ids, params, parent_id, pooling, images=images))

    def abort(self, request_id: str) -> None:
        route = self._forget(request_id)
        if route is not None:
            route.replica.outbox.put(AbortSequence(request_id))

    def cancel_all(self, error: BaseException) -> None:
        for request_id, route in list(self._routes.items()):
            self._forget(request_id)
            route.queue.put_nowait(error)
            route.replica.outbox.put(AbortSequence(request_id))

    def stop_now(self, error: BaseException) -> None:
        self._draining = True
        self.cancel_all(error)
        self._stopping = True
        for replica in self.replicas:
            if replica.process is not None:
                replica.process.kill()

    async def stop(self, timeout_s: float = STOP_JOIN_S) -> None:
        """Tell every replica to stop, wait for them (bounded), kill what is left."""
        self._stopping = True
        for replica in self.replicas:
            replica.outbox.put(None)
        await asyncio.to_thread(self._join_all, timeout_s)
        self.cancel_all(EngineUnavailableError("the server shut down before the request finished"))

    def _join_all(self, timeout_s: float) -> None:
        for replica in self.replicas:
            if replica.process is not None:
                replica.process.join(timeout_s)
                if replica.process.is_alive():
                    replica.process.kill()
                    replica.process.join()

    def _route(self, prompt_ids: list[int], params: SamplingParams, parent_id: str | None) -> Replica:
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise EngineUnavailableError("every data-parallel replica has stopped")
        if parent_id in self._parents and self._parents[parent_id][0].alive:
            return self._parents[parent_id][0]
        keys = self._block_keys(prompt_ids, params)
        replica = max(live, key=lambda r: (_cached_run(r.cached, keys), -r.in_flight, -r.index))
        for key in keys:
            replica.cached[key] = None
            replica.cached.move_to_end(key)
        while len(replica.cached) > replica.ready.num_blocks:
            replica.cached.popitem(last=False)
        return replica

    def _block_keys(self, prompt_ids: list[int], params: SamplingParams) -> list[bytes]:
        config = self.plan.config
        if not config.enable_prefix_caching:
            return []
        full_blocks = (len(prompt_ids) - 1) // config.block_size  # the last token is always computed
        return block_keys(prompt_ids, config.block_size, full_blocks, chain_root(params.cache_salt))

    def _forget(self, request_id: str) -> _Route | None:
        route = self._routes.pop(request_id, None)
        if route is None:
            return None
        route.replica.in_flight -= 1
        if route.parent_id is not None:
            replica, count = self._parents[route.parent_id]
            if count > 1:
                self._parents[route.parent_id] = (replica, count - 1)
            else:
                del self._parents[route.parent_id]
        return route

    def _deliver(self, replica: Replica, delivered: list[RequestOutput | tuple[str, BaseException]],
                 snapshot: EngineSnapshot) -> None:
        replica.snapshot = snapshot
        for item in delivered:
            if isinstance(item, tuple):
                route = self._forget(item[0])
                if route is not None:
                    route.queue.put_nowait(item[1])
                continue
            route = self._routes.get(item.request_id)
            if route is None:
                continue  # aborted by its reader while the step ran
            if item.finished:
                self._forget(item.request_id)
            route.queue.put_nowait(item)

    def _replica_exited(self, replica: Replica) -> None:
        """On the event loop: fail what it held; the pool dies if it was starting or was the last."""
        if self._stopping:
            return
        message = f"{replica.name} {replica.exit_reason}"
        failed = [rid for rid, route in self._routes.items() if route.replica is replica]
        for request_id in failed:
            self._forget(request_id).queue.put_nowait(EngineUnavailableError(
                f"{message} while serving this request; the other replicas still serve, retry"))
        if self.ready and any(r.alive for r in self.replicas):
            log.error("%s; %d in-flight sequences failed, the other replicas keep serving",
                      message, len(failed))
            return
        self._die(replica.failure or EngineUnavailableError(message))

    def _die(self, error: BaseException) -> None:
        if self.dead is not None:
            return
        self.dead = error
        self.cancel_all(EngineUnavailableError(f"the engine loop died: {error!r}"))
        if self._on_death is not None:
            self._on_death(error)

    # -- threads --------------------------------------------------------------------------------

    def _start_replicas(self) -> None:
        """Replica 0 first; the others then with its kernel, all at once. Then the admission."""
        try:
            first = self.replicas[0]
            self._launch(first, self.plan.config)
            first.started.wait()
            if first.ready is None:
                return  # its reader reports why
            log.info("%s ready: %s", first.name, first.ready.kernel_summary)
            pinned = dataclasses.replace(self.plan.config, linear_kernel=first.ready.linear_kernel)
            for replica in self.replicas[1:]:
                self._launch(replica, pinned)
            for replica in self.replicas[1:]:
                replica.started.wait()
            if any(r.ready is None for r in self.replicas):
                return
            admission = replica_admission(self.plan.config, first.ready)
            self._check_engine(admission)
            self._admission = admission
            self.ready = True
            log.info("%d data-parallel replicas ready", self.plan.size)
        except BaseException as error:
            log.exception("the data-parallel replicas did not start")
            self._call_soon(self._die, error)

    def _launch(self, replica: Replica, config: EngineConfig) -> None:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=run_replica, args=(config, replica.cpus, theirs),
                                        name=f"nanoserve-replica-{replica.index}", daemon=True)
        process.start()
        theirs.close()  # ours alone: its end closing is how we learn the replica exited
        replica.process, replica.conn = process, ours
        threading.Thread(target=self._write, args=(replica,), name=f"nanoserve-replica-{replica.index}-out",
                         daemon=True).start()
        threading.Thread(target=self._read, args=(replica,), name=f"nanoserve-replica-{replica.index}-in",
                         daemon=True).start()

    def _write(self, replica: Replica) -> None:
        while True:
            command = replica.outbox.get()
            try:
                replica.conn.send(command)
            except (OSError, ValueError):
                return  # the replica exited: its reader reports it
            if command is None:
                return

    def _read(self, replica: Replica) -> None:
        try:
            while True:
                kind, *payload = replica.conn.recv()
                if kind == "step":
                    self._call_soon(self._deliver, replica, *payload)
                elif kind == "ready":
                    replica.ready = payload[0]
                    replica.started.set()
                else:
                    replica.failure = payload[0]
        except (EOFError, OSError):
            pass
        replica.process.join(5.0)
        replica.exit_reason = _exit_reason(replica.process)
        replica.started.set()
        self._call_soon(self._replica_exited, replica)


def _cached_run(cached: OrderedDict[bytes, None], keys: list[bytes]) -> int:
    """How many of `keys`, from the first, were sent to this replica."""
    run = 0
    for key in keys:
        if key not in cached:
            break
        run += 1
    return run


def _exit_reason(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return f"(pid {process.pid}) closed its pipe"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"(pid {process.pid}) was killed by {signal.Signals(-code).name}"
    return f"(pid {process.pid}) exited with code {code}"
