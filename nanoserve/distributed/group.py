"""Tensor parallelism's processes: the group, a step's messages, launching, faults.

Owns:
- starting the N-1 local workers (one process a rank, running the program its caller names:
  the executor, `nanoserve.engine.executor`, names the worker's loop) or joining a torchrun
  launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), after every check that can fail without
  them (heads that do not divide, N above the cores or GPUs, a port in use).
- the start-up plan (`RankPlan`: the kernel, the KV blocks, the context) rank 0 decides and
  every worker takes as it is, so every rank runs one kernel and holds as many KV blocks.
- the step message: rank 0 alone schedules and samples; each step it broadcasts the
  `ForwardBatch` as ONE int64 buffer (a header, the batch's shapes, its tensors flattened),
  every rank runs its shard of the forward, and rank 0 gathers the logits each rank owns.
- faults: rank 0 polls its local workers and exits naming the rank of one that died; every
  collective of a step times out after STEP_TIMEOUT_S, and the error names the ranks whose
  heartbeat (a store key each worker refreshes every second) went stale; a worker whose rank 0
  is gone exits. Connecting to MASTER_ADDR gives up after CONNECT_TIMEOUT_S.
What each rank holds is `shards`; the collectives of its forward are `collectives`; a worker's
life is `nanoserve.worker.loop`; when ranks start and stop is the executor's.
Refuses: pipeline parallelism, and a draft model beside tensor parallelism.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.distributed import shared_memory
from nanoserve.distributed.collectives import Collectives
from nanoserve.distributed.shards import OPTION, Shard, check_shardable, splits_by_output
from nanoserve.distributed.shared_memory import SharedMemoryGroup
from nanoserve.errors import InvalidRequestError, NanoserveError
from nanoserve.model.batch import AttentionGroup, ForwardBatch
from nanoserve.model.linear import KERNEL_NAMES

log = logging.getLogger("nanoserve")

# A step's collectives: a rank silent this long is dead or hung (the test: within 30 s).
STEP_TIMEOUT_S = float(os.environ.get("NANOSERVE_TP_TIMEOUT_S", "30"))
# Joining the group: a rank that cannot reach MASTER_ADDR:MASTER_PORT gives up after this.
CONNECT_TIMEOUT_S = float(os.environ.get("NANOSERVE_TP_CONNECT_TIMEOUT_S", "60"))
# A worker waits for the next step as long as the server idles.
PLAN_TIMEOUT = timedelta(days=30)
# A worker refreshes its heartbeat key this often (tests shorten it to keep the thread busy).
HEARTBEAT_S = float(os.environ.get("NANOSERVE_TP_HEARTBEAT_S", "1.0"))
WATCHDOG_POLL_S = 0.2
WATCHDOG_GRACE_S = 5.0  # after a worker died: time for the step in flight to fail on its own
MESSAGE_START_WORDS = 4096  # the step buffer grows (both sides, by a resize message) when needed
_STOP, _RESIZE = 0, -1  # header words other than a payload length


class TensorParallelError(NanoserveError):
    """A rank died, hung or could not be reached; the message names it."""


# ---- the step message ------------------------------------------------------------------------


def encode_batch(batch: ForwardBatch) -> torch.Tensor:
    """The batch as one flat int64 tensor: [meta length, meta..., data...]; no readback."""
    meta = [len(batch.groups), batch.input_ids.shape[0], batch.logits_rows.shape[0]]
    data = [batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_rows]
    for group in batch.groups:
        firsts = group.first_positions
        meta += [group.row_start, group.num_seqs, group.rows_per_seq, *group.block_tables.shape,
                 firsts is not None, *(firsts or ())]
        data += [group.positions.reshape(-1), group.block_tables.reshape(-1)]
    head = torch.tensor([len(meta), *meta], dtype=torch.long)
    return torch.cat([head, *(t.to("cpu", torch.long).reshape(-1) for t in data)])


def decode_batch(words: torch.Tensor, device: torch.device) -> ForwardBatch:
    meta_len = int(words[0])
    meta = words[1:1 + meta_len].tolist()
    data = words[1 + meta_len:].to(device)
    num_groups, rows, logits = meta[:3]
    at = 0

    def next_tensor(count: int, shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal at
        at += count
        return data[at - count:at].view(shape)

    input_ids, positions, slots = (next_tensor(rows, (rows,)) for _ in range(3))
    logits_rows = next_tensor(logits, (logits,))
    groups, m = [], 3
    for _ in range(num_groups):
        row_start, seqs, per_seq, t_rows, t_cols, has_firsts = meta[m:m + 6]
        firsts = tuple(meta[m + 6:m + 6 + seqs]) if has_firsts else None
        m += 6 + (seqs if has_firsts else 0)
        group_positions = next_tensor(seqs * per_seq, (seqs, per_seq))
        tables = next_tensor(t_rows * t_cols, (t_rows, t_cols))
        groups.append(AttentionGroup(row_start, seqs, per_seq, group_positions, tables, firsts))
    return ForwardBatch(input_ids, positions, slots, groups, logits_rows)


# ---- the group: joining, the step's messages, faults ------------------------------------------


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What rank 0 decides at start-up and every rank builds to: one kernel, as many KV blocks,
    one context."""

    kernel_name: str
    num_blocks: int
    max_positions: int


@dataclass(slots=True)
class Worker:
    rank: int
    process: subprocess.Popen


@dataclass
class TensorParallelGroup:
    """One rank's membership: the plan group (gloo, waits as long as the server idles), the step
    group (gloo or NCCL, STEP_TIMEOUT_S), and on rank 0 the local workers it started."""

    shard: Shard
    store: dist.Store
    plan_group: dist.ProcessGroup
    step_group: dist.ProcessGroup
    device: torch.device
    workers: list[Worker] = field(default_factory=list)
    spec: WorkerSpec | None = None  # what a torchrun worker builds (its own process knows it)
    collectives: Collectives | None = None
    message_words: int = MESSAGE_START_WORDS
    closed: bool = False
    failed: bool = False  # a step's collective failed: close() kills the workers, asks nothing

    def make_collectives(self, config: ModelConfig, batch_invariant: bool) -> Collectives:
        start, count, _ = self.shard.vocab_rows(config.vocab_size)
        self.collectives = Collectives(self.step_group, self.shard, start, count, batch_invariant,
                                       self._shared_memory())
        return self.collectives

    def _shared_memory(self) -> SharedMemoryGroup | None:
        """The forward's collectives through one shared buffer when every rank runs on this
        machine's CPU (the machine ids each rank stored on joining agree); gloo's otherwise."""
        if self.device.type != "cpu" or not shared_memory.enabled():
            return None
        here = shared_memory.machine_id()
        if any(self.store.get(f"machine/{rank}").decode() != here for rank in range(self.shard.world)):
            return None
        check = self._raise_if_a_worker_exited if self.workers else None
        return SharedMemoryGroup.join(self.store, self.shard.rank, self.shard.world, STEP_TIMEOUT_S,
                                      check=check)

    def _raise_if_a_worker_exited(self) -> None:
        """Ends a shared-memory wait (`failure` then names the rank)."""
        if self._dead_workers():
            raise RuntimeError("shared-memory collective: a worker process exited")

    # Rank 0's side of a step.
    def send_batch(self, batch: ForwardBatch) -> None:
        payload = encode_batch(batch)
        words = payload.shape[0] + 1
        if words > self.message_words:
            grown = max(words, 2 * self.message_words)
            self._broadcast(torch.tensor([_RESIZE, grown] + [0] * (self.message_words - 2)))
            self.message_words = grown
        message = torch.zeros(self.message_words, dtype=torch.long)
        message[0] = payload.shape[0]
        message[1:words] = payload
        self._broadcast(message)

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        parts = [torch.empty_like(logits) for _ in range(self.shard.world)]
        self.step_group.gather([parts], [logits], dist.GatherOptions()).wait()
        return torch.cat(parts, dim=1)[:, :vocab_size]

    # A worker's side.
    def receive_batch(self) -> ForwardBatch | None:
        while True:
            message = torch.empty(self.message_words, dtype=torch.long)
            self.plan_group.broadcast(message, 0).wait()
            words = int(message[0])
            if words == _STOP:
                return None
            if words == _RESIZE:
                self.message_words = int(message[1])
                continue
            return decode_batch(message[1:1 + words], self.device)

    def send_logits(self, logits: torch.Tensor) -> None:
        self.step_group.gather([], [logits], dist.GatherOptions()).wait()

    def send_plan(self, plan: RankPlan) -> None:
        """Rank 0's start-up plan to every worker, over the plan group."""
        names = list(KERNEL_NAMES)
        self.plan_group.broadcast(torch.tensor([names.index(plan.kernel_name), plan.num_blocks,
                                                plan.max_positions]), 0).wait()

    def receive_plan(self) -> RankPlan:
        buffer = torch.empty(3, dtype=torch.long)
        self.plan_group.broadcast(buffer, 0).wait()
        kernel, num_blocks, max_positions = buffer.tolist()
        return RankPlan(list(KERNEL_NAMES)[kernel], num_blocks, max_positions)

    def _broadcast(self, message: torch.Tensor) -> None:
        self.plan_group.broadcast(message, 0).wait(timedelta(seconds=STEP_TIMEOUT_S))

    def failure(self, error: Exception) -> TensorParallelError:
        """The error of a failed step, naming the ranks that died (local workers, reaped a moment
        after their sockets close) or whose heartbeat went stale (any rank, a few seconds on)."""
        deadline = time.monotonic() + (2.0 if self.workers else 4.5 * HEARTBEAT_S)
        while not (named := self._dead_workers() or self._stale_ranks()) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.failed = True
        return TensorParallelError(f"tensor parallel: a step's collective failed "
                                   f"({', '.join(named) or 'no rank identified'}): {error}")

    def _stale_ranks(self) -> list[str]:
        now, stale = time.time(), []
        for rank in range(1, self.shard.world):
            key = f"heartbeat/{rank}"
            try:  # check first: a get of a key never set waits for the store's whole timeout
                beat = float(self.store.get(key).decode()) if self.store.check([key]) else 0.0
            except Exception:  # the store itself may be gone with the rank
                beat = 0.0
            if now - beat > 3 * HEARTBEAT_S:
                stale.append(f"rank {rank} (silent for over {3 * HEARTBEAT_S:.0f} s)")
        return stale

    def _dead_workers(self) -> list[str]:
        return [f"rank {w.rank} (exit status {w.process.poll()})" for w in self.workers
                if w.process.poll() is not None]

    def close(self) -> None:
        """Rank 0: tell the workers to stop, and wait for them (a few seconds at most)."""
        if self.closed:
            return
        self.closed = True
        if self.collectives is not None and self.collectives.local is not None:
            self.collectives.local.close()
        if self.shard.rank == 0 and self.failed:
            for worker in self.workers:
                worker.process.kill()
        elif self.shard.rank == 0:
            try:
                self._broadcast(torch.tensor([_STOP] + [0] * (self.message_words - 1)))
            except Exception as error:
                log.debug(f"tensor parallel: stop message not delivered: {error}")
            for worker in self.workers:
                try:
                    worker.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    worker.process.kill()


class ShardedModel:
    """Rank 0's model across every rank, what `ModelRunner` calls: the full config (for the
    sampler's vocabulary), and a forward that sends the batch, runs rank 0's shard and gathers
    the logits every rank owns."""

    def __init__(self, local, config: ModelConfig, group: TensorParallelGroup) -> None:
        self.local = local
        self.config = config
        self.group = group

    def forward(self, batch: ForwardBatch, kv_cache) -> torch.Tensor:
        try:
            self.group.send_batch(batch)
            logits = self.local.forward(batch, kv_cache)
            return self.group.gather_logits(logits, self.config.vocab_size)
        except RuntimeError as error:  # gloo's and NCCL's errors: timeouts, closed connections
            raise self.group.failure(error) from error


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                    and "MASTER_ADDR" in os.environ)


def is_torchrun_worker() -> bool:
    """Whether this process is a rank > 0 of a torchrun launch (it runs no front end)."""
    return launched_by_torchrun() and int(os.environ["RANK"]) > 0


def local_ranks(config: EngineConfig) -> int:
    """How many ranks share this machine's cores."""
    if launched_by_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return config.tensor_parallel_size


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_launch(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 by_output: bool = False) -> None:
    """Everything that can fail before a worker starts: the split, the devices or cores, torchrun's
    world against the option."""
    world = config.tensor_parallel_size
    check_shardable(model_config, world, by_output)
    if config.draft_model is not None and world > 1:
        raise InvalidRequestError("a draft model does not run beside tensor parallelism; use "
                                  "--speculative-method ngram or tensor_parallel_size 1", param=OPTION)
    if launched_by_torchrun():
        launched = int(os.environ["WORLD_SIZE"])
        if launched != world:
            raise InvalidRequestError(f"torchrun started {launched} processes and tensor_parallel_size is "
                                      f"{world}: they must be equal", param=OPTION)
        return
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise InvalidRequestError(f"tensor_parallel_size {world} is more than the "
                                  f"{torch.cuda.device_count()} GPUs torch sees", param=OPTION)
    if device.type == "cpu" and world > cores() and config.threads is None:
        raise InvalidRequestError(f"tensor_parallel_size {world} is more ranks than this machine's {cores()} "
                                  "cores; pass --threads 1 to run them anyway, sharing cores", param=OPTION)


def _master() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT (a free port when unset), refused if the port is taken."""
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "0"))
    with socket.socket() as probe:
        try:
            probe.bind((address, port))
        except OSError as error:
            raise InvalidRequestError(f"MASTER_PORT {port} on {address} is not free for the tensor-parallel "
                                      f"group ({error.strerror}); set MASTER_PORT to a free port",
                                      param=OPTION) from None
        return address, probe.getsockname()[1]


def join(rank: int, world: int, address: str, port: int, device: torch.device,
         by_output: bool = False) -> TensorParallelGroup:
    """Rendezvous at address:port (rank 0 serves the store) and build the two groups; `by_output`:
    the shard's layout (`shards.splits_by_output`)."""
    url = f"tcp://{address}:{port}?rank={rank}&world_size={world}"
    try:
        store, _, _ = next(dist.rendezvous(url, timeout=timedelta(seconds=CONNECT_TIMEOUT_S)))
    except (RuntimeError, ValueError, OSError) as error:  # DistStoreError is a RuntimeError
        raise TensorParallelError(f"tensor parallel: rank {rank} could not reach the group at "
                                  f"{address}:{port} within {CONNECT_TIMEOUT_S:.0f} s (MASTER_ADDR, "
                                  f"MASTER_PORT): {error}") from None
    return _groups(store, Shard(rank, world, by_output), device)


def _groups(store: dist.Store, shard: Shard, device: torch.device) -> TensorParallelGroup:
    rank, world = shard.rank, shard.world
    plan = dist.ProcessGroupGloo(dist.PrefixStore("plan", store), rank, world, PLAN_TIMEOUT)
    store.set(f"machine/{rank}", shared_memory.machine_id())
    step_store = dist.PrefixStore("step", store)
    if device.type == "cuda":
        step = dist.ProcessGroupNCCL(step_store, rank, world)
    else:
        step = dist.ProcessGroupGloo(step_store, rank, world, timedelta(seconds=STEP_TIMEOUT_S))
    return TensorParallelGroup(shard, store, plan, step, device)


def join_torchrun(device: torch.device, by_output: bool) -> TensorParallelGroup:
    """The group of a torchrun launch (env:// rendezvous: its agent's store where it has one)."""
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=CONNECT_TIMEOUT_S)))
    except (RuntimeError, ValueError, OSError) as error:
        master = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise TensorParallelError(f"tensor parallel: could not reach MASTER_ADDR {master} within "
                                  f"{CONNECT_TIMEOUT_S:.0f} s: {error}") from None
    return _groups(store, Shard(rank, world, by_output), device)


def worker_spec(config: EngineConfig, *, model_dir: Path, gguf: Path | None, threads: int | None,
                device: torch.device) -> WorkerSpec:
    """What every worker builds: rank 0's config, the checkpoint it resolved, the threads of a rank."""
    return WorkerSpec(dataclasses.asdict(config), str(model_dir), str(gguf) if gguf else None, threads,
                      str(device))


def start_local(config: EngineConfig, model_config: ModelConfig, spec: WorkerSpec, device: torch.device,
                command: list[str]) -> TensorParallelGroup:
    """Rank 0's group, its N-1 local workers started, each `command + [payload]` (the caller
    names the program; the payload is `spec`, the rank, the world, the store's address and
    rank 0's pid)."""
    check_launch(config, model_config, device, spec.by_output)
    address, port = _master()
    world = config.tensor_parallel_size
    workers = [Worker(rank, _spawn(command, spec, rank, world, address, port)) for rank in range(1, world)]
    try:
        group = join(0, world, address, port, device, spec.by_output)
    except TensorParallelError:
        for worker in workers:
            worker.process.kill()
        raise
    group.workers = workers
    log.info("tensor parallel: " + ", ".join(f"rank {w.rank} pid {w.process.pid}" for w in workers))
    threading.Thread(target=_watch_workers, args=(group,), daemon=True, name="nanoserve-tp-watchdog").start()
    return _on_rank_zero(group)


def start_torchrun(config: EngineConfig, model_config: ModelConfig, spec: WorkerSpec,
                   device: torch.device) -> TensorParallelGroup:
    """This process's group in a torchrun launch, any rank; one of rank > 0 carries the spec it
    builds (`group.spec`, its device its local GPU)."""
    check_launch(config, model_config, device, spec.by_output)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    spec.device = f"cuda:{local}" if device.type == "cuda" else spec.device
    group = join_torchrun(rank_device(spec.device), spec.by_output)
    group.spec = spec
    return group if group.shard.rank != 0 else _on_rank_zero(group)


def _on_rank_zero(group: TensorParallelGroup) -> TensorParallelGroup:
    atexit.register(group.close)
    return group


def rank_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


@dataclass(slots=True)
class WorkerSpec:
    """What a worker needs to build its rank: the engine's config, the model rank 0 resolved."""

    engine: dict
    model_dir: str
    gguf: str | None
    threads: int | None
    device: str

    @property
    def by_output(self) -> bool:
        return splits_by_output(self.gguf, self.engine["quantize"])


def _spawn(command: list[str], spec: WorkerSpec, rank: int, world: int, address: str,
           port: int) -> subprocess.Popen:
    device = f"cuda:{rank}" if spec.device.startswith("cuda") else spec.device
    payload = json.dumps({**dataclasses.asdict(spec), "device": device, "rank": rank, "world": world,
                          "address": address, "port": port, "parent": os.getpid()})
    return subprocess.Popen([*command, payload])


def _watch_workers(group: TensorParallelGroup) -> None:
    """Rank 0: a worker that exits while the group is open ends this process, naming its rank.
    A step in flight fails first, on its own (its collective errors; the server answers 503 to
    what was in flight, then exits); an idle engine ends here, WATCHDOG_GRACE_S later."""
    while not group.closed:
        for worker in group.workers:
            status = worker.process.poll()
            if status is not None and not group.closed:
                message = (f"nanoserve: tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                           f"exited with status {status}; stopping")
                log.error(message)
                print(message, file=sys.stderr, flush=True)
                time.sleep(WATCHDOG_GRACE_S)
                for other in group.workers:
                    if other.process.poll() is None:
                        other.process.kill()
                os._exit(1)
        time.sleep(WATCHDOG_POLL_S)


@contextlib.contextmanager
def heartbeat(group: TensorParallelGroup) -> Iterator[None]:
    """A worker's heartbeat key, refreshed every HEARTBEAT_S while the block runs, and its thread
    joined before the block returns: a thread still inside a store call (C++, the GIL released)
    when the interpreter finalizes is ended from inside that call, and the process aborts with
    "terminate called without an active exception"."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                group.store.set(f"heartbeat/{group.shard.rank}", str(time.time()))
            except Exception:
                return
            stop.wait(HEARTBEAT_S)

    thread = threading.Thread(target=beat, daemon=True, name="nanoserve-tp-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=STEP_TIMEOUT_S)  # a store call gives up within its own timeout
