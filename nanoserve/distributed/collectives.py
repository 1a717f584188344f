"""The collectives of one rank's forward: what `model.decoder` calls with tensor parallelism on.

With batch invariance on, the all-reduce is an all-gather of the partials summed in rank order
0..N-1 on every rank, so a row's bits never depend on how a ring all-reduce chunked the batch;
off, gloo's (or NCCL's) own all-reduce. The vocabulary-parallel embedding is exact either way
(one rank's row plus -0.0 elsewhere).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve import quant
from nanoserve.distributed.shards import Shard
from nanoserve.model.linear import embedding


@dataclass(slots=True)
class Collectives:
    """What model.py calls with tensor parallelism on: two all-reduces a layer, the embedding."""

    group: dist.ProcessGroup
    shard: Shard
    vocab_start: int
    vocab_count: int
    ordered: bool  # batch-invariant: all-gather, then sum in rank order
    reduce_s: float = 0.0  # seconds inside the all-reduces, for `nanoserve profile`
    reduces: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        if self.ordered:
            parts = [torch.empty_like(x) for _ in range(self.shard.world)]
            self.group.allgather([parts], [x.contiguous()]).wait()
            out = parts[0]
            for part in parts[1:]:
                out += part
        else:
            out = x.contiguous()
            self.group.allreduce([out]).wait()
        self.reduce_s += time.perf_counter() - start
        self.reduces += 1
        return out

    def embedding(self, ids: torch.Tensor, table: quant.Weight) -> torch.Tensor:
        """Rows of the ids this rank holds, -0.0 for the rest, summed over ranks: exact, since
        x + (-0.0) is x for every x, in any order."""
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_count)
        rows = embedding(torch.where(inside, local, 0), table)
        rows.masked_fill_(~inside.unsqueeze(-1), -0.0)
        self.group.allreduce([rows]).wait()
        return rows
