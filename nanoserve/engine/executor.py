"""The executor: rank 0's hold on every rank, between the engine and the ranks.

Owns:
- start: with one rank, rank 0 built in this process; with tensor parallelism, the N-1 local
  workers spawned (each runs `nanoserve.worker.loop`, named here by its module) or a torchrun
  launch joined, then this rank's shard loaded, the plan (`worker.startup.plan_rank`: the
  kernel, the KV blocks, the context) decided and sent, and rank 0 built to it;
- a step: the runner's model (`runner_model`): rank 0's own, or every rank's (`ShardedModel`
  sends the batch, runs rank 0's shard and gathers the logits);
- stop: `close` tells the workers to stop and waits for them; a start that fails or is called
  off kills the workers it started.
- calling a start off: a start run inside `stoppable_start(event)` checks the event between its
  phases (before the workers start, the weights load, the kernel is measured, the KV cache is
  allocated) and raises `StartCancelled` once it is set, so a process told to stop while the
  model loads leaves with no thread inside torch when the interpreter finalizes.
Refuses: being rank > 0 of a torchrun launch (that process's entry point runs the worker's loop,
`nanoserve.worker.loop.serve_torchrun_rank`), and any decision of the request lifecycle
(`nanoserve.engine.core`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from contextvars import ContextVar

from nanoserve import huge_pages
from nanoserve.config import EngineConfig
from nanoserve.distributed import group as tp_group
from nanoserve.distributed.group import ShardedModel, TensorParallelGroup
from nanoserve.errors import NanoserveError
from nanoserve.loading.weights import read_config
from nanoserve.worker import loop as worker_loop
from nanoserve.worker.rank import Rank
from nanoserve.worker.startup import Startup, load_rank_weights, plan_rank, rank_threads, weight_format

# What a local worker process runs: the worker's loop, named by the module object itself.
WORKER_COMMAND = (sys.executable, "-m", worker_loop.__name__)

_stop_start: ContextVar[threading.Event | None] = ContextVar("nanoserve_stop_start", default=None)


class StartCancelled(NanoserveError):
    """The engine's start was called off (the process is stopping); nothing of it is left."""


@contextlib.contextmanager
def stoppable_start(stop: threading.Event) -> Iterator[None]:
    """Engines started inside this block (on this thread) stop starting once `stop` is set."""
    token = _stop_start.set(stop)
    try:
        yield
    finally:
        _stop_start.reset(token)


def check_start(before: str) -> None:
    """Raise `StartCancelled` if this thread's start was called off (`stoppable_start`)."""
    stop = _stop_start.get()
    if stop is not None and stop.is_set():
        raise StartCancelled(f"start-up called off before {before}")


class Executor:
    """Every rank, from rank 0: started by the constructor, stepped through `runner_model`,
    stopped by `close`. With tensor parallelism `model` is rank 0's shard (its config the
    shard's) and `runner_model` every rank's."""

    def __init__(self, config: EngineConfig, startup: Startup) -> None:
        self.config = config
        self.startup = startup
        check_start("the workers start")
        # The workers start here, after every check that needs none of them (`Startup.decide`).
        self.group = self._start_group()
        try:
            self._build_rank_zero()
        except BaseException:
            self._abandon()
            raise

    def _start_group(self) -> TensorParallelGroup | None:
        """Rank 0's group with its local workers started, or a torchrun launch joined (None
        with one rank)."""
        config, startup = self.config, self.startup
        torchrun = tp_group.launched_by_torchrun()
        if config.tensor_parallel_size == 1 and not torchrun:
            return None
        if tp_group.is_torchrun_worker():
            raise NanoserveError("this process is a rank above 0 of a torchrun launch: its entry point "
                                 "runs the worker's loop (nanoserve.worker.loop.serve_torchrun_rank), "
                                 "not an engine")
        spec = tp_group.worker_spec(config, model_dir=startup.source.dir, gguf=startup.gguf,
                                    threads=rank_threads(config), device=startup.device)
        model_config = read_config(startup.source.dir)
        if torchrun:
            return tp_group.start_torchrun(config, model_config, spec, startup.device)
        return tp_group.start_local(config, model_config, spec, startup.device, list(WORKER_COMMAND))

    def _build_rank_zero(self) -> None:
        config, startup, group = self.config, self.startup, self.group
        check_start("the weights load")
        with startup.phases.timed("weights"):
            self.model_config, weights = load_rank_weights(
                config, startup.source.dir, startup.gguf, startup.dtype, startup.device,
                group.shard if group is not None else None, startup.notes)
        self.weights_nbytes = weights.nbytes()  # this rank's, with tensor parallelism
        if group is not None:
            startup.notes.append(f"tensor parallel: {config.tensor_parallel_size} ranks; rank 0 holds "
                                 f"{self.weights_nbytes / 1e6:.1f} MB of weights")
        self.weight_format = weight_format(weights)
        check_start("the linear kernel is chosen")
        with startup.phases.timed("kernel choice"):
            self.kernel_choice, self.plan = plan_rank(config, self.model_config, weights, startup)
        check_start("the KV cache is allocated")
        if group is not None:
            group.send_plan(self.plan)
        collectives = (group.make_collectives(self.model_config, config.batch_invariant)
                       if group is not None else None)
        rank = Rank.build(config, self.model_config, weights, self.plan, dtype=startup.dtype,
                          device=startup.device, threads=startup.threads, collectives=collectives,
                          phases=startup.phases)
        self.model, self.kv_cache = rank.model, rank.kv_cache
        if startup.device.type == "cpu":
            startup.notes.append(huge_pages.note(rank.huge_page_bytes, self.weights_nbytes))
        self.runner_model = (ShardedModel(self.model, self.model_config, group) if group is not None
                             else self.model)

    def _abandon(self) -> None:
        """A start that failed or was called off: the workers it started are killed, not asked."""
        if self.group is not None:
            self.group.failed = True
            self.group.close()

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op with one rank); no step runs after."""
        if self.group is not None:
            self.group.close()
