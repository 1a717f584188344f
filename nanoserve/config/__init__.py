"""Configuration, a module per concern (as vLLM's `vllm/config/`): what the model is (`model`),
how the engine runs it (`engine`: `EngineConfig`, composed from `load`, `cache`, `scheduler`
and `parallel`). Each setting is declared with one default and checked in one place.

Refuses: reading a checkpoint (`nanoserve.loading.hf_config` reads config.json into
`ModelConfig`) and importing torch.
"""

from nanoserve.config.cache import KV_CACHE_DTYPES, CacheConfig
from nanoserve.config.engine import EngineConfig
from nanoserve.config.load import DTYPES, QUANTIZED, TASKS, LoadConfig
from nanoserve.config.model import Experts, ModelConfig, Rope
from nanoserve.config.parallel import ParallelConfig
from nanoserve.config.scheduler import (
    ASYNC_SCHEDULING_DEFAULT,
    FAIR_SHARE_ROWS_DEFAULT,
    MAX_PREFILL_TOKENS_WHILE_DECODING,
    PREFILL_PACE_MIN_TOKENS,
    PREFILL_STEP_MS_DEFAULT,
    SCHEDULING_POLICIES,
    SchedulerConfig,
)

__all__ = [
    "ASYNC_SCHEDULING_DEFAULT", "DTYPES", "FAIR_SHARE_ROWS_DEFAULT", "KV_CACHE_DTYPES",
    "MAX_PREFILL_TOKENS_WHILE_DECODING", "PREFILL_PACE_MIN_TOKENS", "PREFILL_STEP_MS_DEFAULT", "QUANTIZED",
    "SCHEDULING_POLICIES", "TASKS", "CacheConfig", "EngineConfig", "Experts", "LoadConfig", "ModelConfig",
    "ParallelConfig", "Rope", "SchedulerConfig",
]
