"""The KV cache's settings (`CacheConfig`): the pool's size and block size, and what each slot
stores.

Refuses: sizing or laying out the cache from memory (`worker.rank`, `nanoserve.model.kv_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.errors import InvalidRequestError

# CacheConfig.kv_cache_dtype (model/kv_cache.py's); auto: float16 beside float32 activations
# on the CPU (half the bytes; docs/kv-cache.md), else the activations' dtype.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "q8_0", "fp8")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_gb: float | None = None  # None: kv_cache_fraction of free memory
    kv_cache_fraction: float = 0.25
    num_kv_blocks: int | None = None  # an exact pool size (tests use tiny pools)
    # What the KV cache stores (model/kv_cache.py): auto (float16 beside float32 activations on
    # the CPU, else the activations' dtype), float32, float16, bfloat16, q8_0 (int8 with a scale
    # per head per token: 3.8x float32's tokens), fp8 (CUDA).
    kv_cache_dtype: str = "auto"
    # Keep the prefix cache's full blocks in this directory across restarts (engine/prefix_store.py):
    # written when evicted and at close, read back on a later hit; None: memory only.
    prefix_cache_dir: str | None = None
    # The directory's size limit in GB (every model's files in it): least recently used go first.
    prefix_cache_dir_max_gb: float = 10.0

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                                      f"got {self.kv_cache_dtype!r}", param="kv_cache_dtype")
