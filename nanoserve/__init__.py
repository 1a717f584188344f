"""nanoserve: a small, readable LLM inference engine.

`from nanoserve import LLM, SamplingParams`. The heavy names are imported lazily, so the
torch-free modules (the scheduler, the block pool, the sampling parameters) stay importable
without pulling in torch.
"""

from importlib import import_module

from nanoserve import openmp

openmp.configure()  # before anything imports torch: libgomp reads it once

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "nanoserve.llm",
    "Completion": "nanoserve.llm",
    "CompletionOutput": "nanoserve.llm",
    "Engine": "nanoserve.engine.core",
    "EngineConfig": "nanoserve.config",
    "SamplingParams": "nanoserve.sampling_params",
    "PoolingParams": "nanoserve.pooling_params",
    "Embedding": "nanoserve.llm",
    "LoRARequest": "nanoserve.model.lora",
    "RequestOutput": "nanoserve.engine.output",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
