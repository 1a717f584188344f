"""A tensor-parallel worker: one rank's loop, and nothing of rank 0's.

A worker loads its shard, builds its rank (`nanoserve.worker.rank`) to the plan rank 0 sends,
then runs every step rank 0 broadcasts until it says stop. It takes its threads and dtype from
the same start-up policy as rank 0 (`nanoserve.worker.startup`), and decides nothing else.

Two ways in:
- a local worker: `python -m nanoserve.worker.loop PAYLOAD`, as the executor
  (`nanoserve.engine.executor`) starts it; PAYLOAD is the JSON `distributed.group` writes (the
  `WorkerSpec`, this process's rank, the world size, where rank 0's store listens, and rank 0's
  pid: a worker whose rank 0 is gone exits);
- a torchrun rank > 0: the command's entry point calls `serve_torchrun_rank` instead of
  building an engine (it never serves HTTP nor schedules).
Refuses: anything rank 0 decides (the kernel, the KV blocks, the context come in the plan).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from nanoserve.config import EngineConfig
from nanoserve.distributed import group as tp_group
from nanoserve.distributed.group import HEARTBEAT_S, TensorParallelError, TensorParallelGroup, WorkerSpec
from nanoserve.loading.weights import read_config
from nanoserve.worker.rank import Rank
from nanoserve.worker.startup import Startup, load_rank_weights, pick_dtype, rank_threads, set_threads


def serve_worker(spec: WorkerSpec, group: TensorParallelGroup) -> int:
    """A worker's life: load its shard, build its rank to rank 0's plan, then run every step
    rank 0 sends until it says stop. Returns the exit status."""
    with tp_group.heartbeat(group):
        return _serve_worker(spec, group)


def _serve_worker(spec: WorkerSpec, group: TensorParallelGroup) -> int:
    config = EngineConfig(**spec.engine)
    threads = set_threads(spec.threads)
    dtype = pick_dtype(config.dtype, group.device)
    gguf = Path(spec.gguf) if spec.gguf else None
    model_config, weights = load_rank_weights(config, Path(spec.model_dir), gguf, dtype, group.device,
                                              group.shard, [])
    rank = Rank.build(config, model_config, weights, group.receive_plan(), dtype=dtype, device=group.device,
                      threads=threads,
                      collectives=group.make_collectives(model_config, config.batch_invariant))
    try:
        while (batch := group.receive_batch()) is not None:
            group.send_logits(rank.model.forward(batch, rank.kv_cache))
    except RuntimeError as error:
        print(f"nanoserve: tensor-parallel rank {group.shard.rank}: lost the group ({error}); exiting",
              file=sys.stderr, flush=True)
        return 1
    return 0


def serve_torchrun_rank(config: EngineConfig) -> int:
    """A torchrun rank > 0, from its command's entry point: the checks rank 0 runs before any
    load, then the group, then the worker's life. Returns the exit status."""
    startup = Startup.decide(config)
    spec = tp_group.worker_spec(config, model_dir=startup.source.dir, gguf=startup.gguf,
                                threads=rank_threads(config), device=startup.device)
    group = tp_group.start_torchrun(config, read_config(startup.source.dir), spec, startup.device)
    return serve_worker(group.spec, group)


def _watch_parent(parent: int) -> None:
    """A local worker whose rank 0 is gone (even killed) exits too."""
    while os.getppid() == parent:
        time.sleep(HEARTBEAT_S)
    os._exit(1)


def main(argv: list[str]) -> int:
    raw = json.loads(argv[0])
    threading.Thread(target=_watch_parent, args=(raw.pop("parent"),), daemon=True).start()
    rank, world, address, port = (raw.pop(k) for k in ("rank", "world", "address", "port"))
    spec = WorkerSpec(**raw)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(message)s")
    try:
        group = tp_group.join(rank, world, address, port, tp_group.rank_device(spec.device), spec.by_output)
    except TensorParallelError as error:
        print(f"nanoserve: {error}", file=sys.stderr, flush=True)
        return 1
    return serve_worker(spec, group)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
