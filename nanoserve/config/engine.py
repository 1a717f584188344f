"""How the engine runs (`EngineConfig`): the flat settings a caller passes (as vLLM's EngineArgs
builds its VllmConfig), each declared, with its one default and its one check, by its concern's
config: `load` (`LoadConfig`), `cache` (`CacheConfig`), `scheduler` (`SchedulerConfig`),
`parallel` (`ParallelConfig`), `multimodal` (`MultiModalConfig`); speculative decoding's are
checked by `engine.spec_decode.SpecConfig`.

Refuses: resolving what depends on the device or the model (the engine does, at start-up,
through `scheduler_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanoserve.config.cache import CacheConfig
from nanoserve.config.load import LoadConfig
from nanoserve.config.multimodal import MultiModalConfig
from nanoserve.config.parallel import ParallelConfig
from nanoserve.config.scheduler import SchedulerConfig, resolve_fair_share_rows, resolve_prefill_step_s
from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.limits import ImageLimits

# Each concern's defaults, which EngineConfig's fields take as theirs.
_LOAD, _CACHE, _SCHEDULER, _PARALLEL = LoadConfig(), CacheConfig(), SchedulerConfig(), ParallelConfig()
_MULTIMODAL = MultiModalConfig()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs: where, in what precision, and how much it may batch and cache. A
    field's meaning is documented in the concern config that declares it."""

    model: str | None = _LOAD.model
    dtype: str = _LOAD.dtype
    quantize: str | None = _LOAD.quantize
    device: str | None = _LOAD.device
    block_size: int = _CACHE.block_size
    max_num_seqs: int = _SCHEDULER.max_num_seqs
    max_num_batched_tokens: int = _SCHEDULER.max_num_batched_tokens
    max_prefill_tokens_while_decoding: int | None = _SCHEDULER.max_prefill_tokens_while_decoding
    max_model_len: int | None = _LOAD.max_model_len
    kv_cache_gb: float | None = _CACHE.kv_cache_gb
    kv_cache_fraction: float = _CACHE.kv_cache_fraction
    num_kv_blocks: int | None = _CACHE.num_kv_blocks
    kv_cache_dtype: str = _CACHE.kv_cache_dtype
    prefix_cache_dir: str | None = _CACHE.prefix_cache_dir
    prefix_cache_dir_max_gb: float = _CACHE.prefix_cache_dir_max_gb
    batch_invariant: bool = _LOAD.batch_invariant
    enable_prefix_caching: bool = _SCHEDULER.enable_prefix_caching
    linear_kernel: str | None = _LOAD.linear_kernel
    threads: int | None = _LOAD.threads
    # Speculative decoding (exact: tokens and logprobs as without it, under batch invariance):
    # up to this many drafts per request per step, 0 off; proposed by prompt lookup over
    # n-grams of speculative_ngram_max down to speculative_ngram_min tokens.
    speculative_tokens: int = 0
    speculative_method: str = "ngram"
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    # How many drafts a request carries: "cost" (as many as pay for their rows, by its measured
    # acceptance and the step's cost by rows: spec_decode's docstring) or "always" (all it can);
    # and vLLM's cut-off: no drafts while at least this many requests decode (None: no cut-off).
    speculative_policy: str = "cost"
    speculative_disable_by_batch_size: int | None = None
    # speculative_method "draft": the small model (same tokenizer and vocabulary) that proposes
    # the drafts, greedily, from its own KV cache.
    draft_model: str | None = None
    # Deferred output (vLLM's --async-scheduling): step N+1 is launched before step N's tokens
    # are resolved on the host. None: ASYNC_SCHEDULING_DEFAULT for the device.
    async_scheduling: bool | None = None
    # SchedulerConfig.fair_share_rows; None: FAIR_SHARE_ROWS_DEFAULT for the device.
    fair_share_rows: float | None = None
    long_prefill_token_threshold: int | None = _SCHEDULER.long_prefill_token_threshold
    # A step no one shares computes the prompt tokens its measured cost fits in about this many
    # ms (SchedulerConfig.prefill_step_s); inf: no pace; None: PREFILL_STEP_MS_DEFAULT for the device.
    prefill_step_ms: float | None = None
    scheduling_policy: str = _SCHEDULER.scheduling_policy
    # LoRA adapters (vLLM's --enable-lora): requests may run with a PEFT adapter each; at most
    # max_loras resident at once, each of rank at most max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # Adapters kept loaded (vLLM's --max-cpu-loras): beyond it the least recently used idle one
    # is unloaded, and loaded again on its next request; None: max(max_loras, 8).
    max_cpu_loras: int | None = None
    tensor_parallel_size: int = _PARALLEL.tensor_parallel_size
    task: str = _LOAD.task
    pooling: str | None = _LOAD.pooling
    image_limits: ImageLimits = _MULTIMODAL.image_limits
    mmproj: str | None = _MULTIMODAL.mmproj

    def __post_init__(self) -> None:
        if self.prefill_step_ms is not None and not self.prefill_step_ms > 0:
            raise InvalidRequestError(f"prefill_step_ms must be > 0 (or inf: no pace); got "
                                      f"{self.prefill_step_ms}", param="prefill_step_ms")
        # Each concern checks its own settings, the scheduler's as a CPU would run them.
        for concern in (LoadConfig, CacheConfig, ParallelConfig):
            concern(**{f.name: getattr(self, f.name) for f in dataclasses.fields(concern)})
        self.scheduler_config(max_model_len=_SCHEDULER.max_model_len, kv_window=0, device_type="cpu")

    def scheduler_config(self, *, max_model_len: int, kv_window: int, device_type: str) -> SchedulerConfig:
        """The scheduler's settings for a model of `max_model_len` and `kv_window` on a device
        of `device_type`, whose defaults fill what this config leaves open (None)."""
        return dataclasses.replace(
            _SCHEDULER, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
            fair_share_rows=resolve_fair_share_rows(self.fair_share_rows, device_type),
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            prefill_step_s=resolve_prefill_step_s(self.prefill_step_ms, device_type),
            scheduling_policy=self.scheduling_policy, kv_window=kv_window,
            max_running_adapters=self.max_loras if self.enable_lora else None)

