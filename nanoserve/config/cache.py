"""The KV cache's settings' values: what the cache may store (`KV_CACHE_DTYPES`).

Refuses: sizing or laying out the cache (`nanoserve.model.kv_cache`, `worker.rank`).
"""

# EngineConfig.kv_cache_dtype (model/kv_cache.py's); auto: the activations' dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "q8_0", "fp8")
