"""Ranks as threads of the test's process: `work(group, rank)` on each of `world` ranks over one
in-process store, the group made by `join(store, rank, world)` (gloo's by default); an error in
any rank is raised in the test's thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist


def gloo(timeout_s: float = 60.0) -> Callable:
    return lambda store, rank, world: dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))


def in_threads(world: int, work: Callable, join: Callable | None = None,
               store: dist.Store | None = None) -> list:
    join = join or gloo()
    store, results, errors = store or dist.HashStore(), [None] * world, []

    def run(rank: int) -> None:
        try:
            results[rank] = work(join(store, rank, world), rank)
        except Exception as error:  # re-raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
