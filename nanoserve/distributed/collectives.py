"""The collectives of one rank's forward: what `model.decoder` calls with tensor parallelism on.

An all-gather is a copy, exact. With batch invariance on, the all-reduce is an all-gather of
the partials summed in rank order 0..N-1 on every rank, so a row's bits never depend on how a
ring all-reduce chunked the batch; off, gloo's (or NCCL's) own all-reduce. The
vocabulary-parallel embedding is exact either way (one rank's row plus -0.0 elsewhere). When
every rank runs on one machine's CPU, both go through one buffer the ranks map
(`shared_memory`), summed in rank order always.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve import quant
from nanoserve.distributed.shards import Shard
from nanoserve.distributed.shared_memory import SharedMemoryGroup
from nanoserve.model.linear import embedding


@dataclass(slots=True)
class Collectives:
    """What the decoder calls with tensor parallelism on: o and down across the ranks (an
    all-reduce each, or two all-gathers each when they are split by output), the embedding."""

    group: dist.ProcessGroup
    shard: Shard
    vocab_start: int
    vocab_count: int
    ordered: bool  # batch-invariant: all-gather, then sum in rank order
    local: SharedMemoryGroup | None = None  # every rank on this machine: its buffer, not gloo
    reduce_s: float = 0.0  # seconds inside o's and down's collectives, for `nanoserve profile`
    reduces: int = 0

    def row_parallel(self, x: torch.Tensor, weight: quant.Weight,
                     linear: Callable[[torch.Tensor, quant.Weight], torch.Tensor]) -> torch.Tensor:
        """x @ W^T for W = o or down, `x` this rank's share of the input columns: split by output,
        the whole input gathered, this rank's outputs, the outputs gathered; else this rank's
        partial product, summed over the ranks."""
        if self.shard.by_output:
            return self.all_gather(linear(self.all_gather(x), weight))
        return self.all_reduce(linear(x, weight))

    @property
    def by_output(self) -> bool:
        """o and every down projection (dense, experts', shared expert's) split by output."""
        return self.shard.by_output

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [rows, cols], side by side in rank order: [rows, N * cols]. Exact."""
        start = time.perf_counter()
        if self.local is not None:
            out = self.local.all_gather(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.shard.world)]
            self.group.allgather([parts], [x.contiguous()]).wait()
            out = torch.cat(parts, dim=1)
        self.reduce_s += time.perf_counter() - start
        self.reduces += 1
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        if self.local is not None:  # in rank order, always
            out = self.local.all_reduce(x)
        elif self.ordered:
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

    def embedding(self, ids: torch.Tensor, table: quant.Weight, *,
                  threads: int | None = None) -> torch.Tensor:
        """Rows of the ids this rank holds (a block table's looked up on `threads` threads), -0.0
        for the rest, summed over ranks: exact, since x + (-0.0) is x for every x, in any order."""
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_count)
        rows = embedding(torch.where(inside, local, 0), table, threads=threads)
        rows.masked_fill_(~inside.unsqueeze(-1), -0.0)
        if self.local is not None:
            return self.local.all_reduce(rows.view(-1, rows.shape[-1])).view(rows.shape)
        self.group.allreduce([rows]).wait()
        return rows
