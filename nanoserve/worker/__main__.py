"""A local tensor-parallel worker process, as rank 0 starts it: `python -m nanoserve.worker PAYLOAD`.

PAYLOAD is the JSON `distributed.group` writes: the `WorkerSpec`, this process's rank, the
world size, where rank 0's store listens, and rank 0's pid (a worker whose rank 0 is gone
exits). The rank itself is built and run by `worker.rank.serve_worker`, as under torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

from nanoserve.distributed.group import HEARTBEAT_S, TensorParallelError, WorkerSpec, join, rank_device
from nanoserve.worker.rank import serve_worker


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
        group = join(rank, world, address, port, rank_device(spec.device), spec.by_output)
    except TensorParallelError as error:
        print(f"nanoserve: {error}", file=sys.stderr, flush=True)
        return 1
    return serve_worker(spec, group)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
