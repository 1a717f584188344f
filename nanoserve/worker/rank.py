"""One rank built to rank 0's plan: its model (its shard of the weights, the plan's kernel, its
collectives with tensor parallelism) and its KV cache (the plan's blocks). Rank 0 (the executor,
`nanoserve.engine.executor`) and every worker (`nanoserve.worker.loop`) build their rank here,
so no rank can build something another did not. What the plan says is decided in
`nanoserve.worker.startup`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from nanoserve import huge_pages
from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.distributed.collectives import Collectives
from nanoserve.distributed.group import RankPlan
from nanoserve.distributed.shards import local_config
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.kv_cache import KVCache, resolve_kv_cache_dtype
from nanoserve.model.linear import kernel_named
from nanoserve.model.weights import LlamaWeights
from nanoserve.worker.startup import StartupPhases


@dataclass(slots=True)
class Rank:
    """One rank's model (its shard, with its collectives) and its KV cache."""

    model: DecoderLM
    kv_cache: KVCache
    huge_page_bytes: int = 0  # of the packed weights, moved onto huge pages at build (huge_pages.py)

    @classmethod
    def build(cls, config: EngineConfig, model_config: ModelConfig, weights: LlamaWeights, plan: RankPlan, *,
              dtype: torch.dtype, device: torch.device, threads: int, collectives: Collectives | None = None,
              phases: StartupPhases | None = None) -> Rank:
        """`threads`: the start-up policy's (`set_threads`), passed to every native call the model
        makes; `phases` (rank 0's) hears how long the model (its weights packed for the kernel)
        and the KV cache took."""
        local = local_config(model_config, config.tensor_parallel_size)
        cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)

        def timed(phase: str) -> contextlib.AbstractContextManager[None]:
            return phases.timed(phase) if phases is not None else contextlib.nullcontext()

        with timed("model"):
            model = DecoderLM(local, weights, batch_invariant=config.batch_invariant,
                              linear_kernel=kernel_named(plan.kernel_name), max_positions=plan.max_positions,
                              tensor_parallel=collectives, kv_cache_dtype=cache_dtype, threads=threads)
        with timed("KV cache"):
            kv_cache = KVCache(local, plan.num_blocks, config.block_size, dtype, device, cache_dtype)
        with timed("huge pages"):
            on_huge_pages = huge_pages.advise(huge_pages.tensors_in(model.weights))
        return cls(model, kv_cache, on_huge_pages)
