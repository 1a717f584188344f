"""How the engine runs (`EngineConfig`): where, in what precision, and how much it may batch and
cache; the flat settings a caller passes (as vLLM's EngineArgs), composed from each concern's
module, which owns its settings' defaults and checks: `scheduler` (`SchedulerConfig`), `cache`,
`load`; speculative decoding's are `engine.spec_decode.SpecConfig`'s.

Refuses: resolving what depends on the device or the model (the engine does, at start-up,
through `scheduler_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanoserve.config.cache import KV_CACHE_DTYPES
from nanoserve.config.load import TASKS
from nanoserve.config.scheduler import FAIR_SHARE_ROWS_DEFAULT, SchedulerConfig, prefill_step_s
from nanoserve.errors import InvalidRequestError
from nanoserve.pooling_params import POOLING_METHODS

# The scheduler's defaults, which EngineConfig's scheduling fields take as theirs.
_SCHEDULER = SchedulerConfig()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs: where, in what precision, and how much it may batch and cache."""

    model: str | None = None
    # auto: a GGUF in its own quantization on a CPU with native kernels, else float32 on CPU
    # and bfloat16 on CUDA; float32 / bfloat16 / float16; quantized (a GGUF's blocks).
    dtype: str = "auto"
    quantize: str | None = None  # q8_0 or q4_0: quantize a float checkpoint's matrices at load
    device: str | None = None  # None: cuda when available, else cpu
    block_size: int = 16
    # The scheduler's settings (config/scheduler.py says what each does).
    max_num_seqs: int = _SCHEDULER.max_num_seqs
    max_num_batched_tokens: int = _SCHEDULER.max_num_batched_tokens
    max_prefill_tokens_while_decoding: int | None = _SCHEDULER.max_prefill_tokens_while_decoding
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_gb: float | None = None  # None: kv_cache_fraction of free memory
    kv_cache_fraction: float = 0.25
    num_kv_blocks: int | None = None  # an exact pool size (tests use tiny pools)
    # What the KV cache stores (model/kv_cache.py): auto (the activations' dtype), float32,
    # bfloat16, q8_0 (int8 with a scale per head per token: 3.8x float32's tokens), fp8 (CUDA).
    kv_cache_dtype: str = "auto"
    # A request's tokens and logprobs do not depend on what shares its steps (DESIGN invariant 1).
    batch_invariant: bool = True
    enable_prefix_caching: bool = _SCHEDULER.enable_prefix_caching
    linear_kernel: str | None = None  # None: the fastest that qualifies, measured at start-up
    threads: int | None = None  # CPU threads; None: every core this process may run on
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
    # While more than one client request runs, each takes at most the lightest one's row units
    # plus this many a step (fair_share.py); inf: off; None: FAIR_SHARE_ROWS_DEFAULT for the device.
    fair_share_rows: float | None = None
    # Most prompt tokens of one request in a step (vLLM's --long-prefill-token-threshold); None:
    # no bound but the step's budgets.
    long_prefill_token_threshold: int | None = _SCHEDULER.long_prefill_token_threshold
    # A step no one shares computes the prompt tokens its measured cost fits in about this many
    # ms (engine/prefill_pace.py); inf: no pace; None: PREFILL_STEP_MS_DEFAULT for the device.
    prefill_step_ms: float | None = None
    # Which waiting request runs first and which running one is preempted first (vLLM's
    # --scheduling-policy): "fcfs" by arrival, "priority" by SamplingParams.priority, then arrival.
    scheduling_policy: str = _SCHEDULER.scheduling_policy
    # LoRA adapters (vLLM's --enable-lora): requests may run with a PEFT adapter each; at most
    # max_loras resident at once, each of rank at most max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # Tensor parallelism (vLLM's --tensor-parallel-size): the model split over this many ranks,
    # one process each (nanoserve.distributed); 1: one process, exactly the code it always ran.
    tensor_parallel_size: int = 1
    # "generate": the model generates and also pools embeddings (/v1/embeddings, LLM.embed);
    # "embed" (vLLM's --task embed): an embedding model, which pools only (generation refused).
    task: str = "generate"
    # How an embedding request pools the prompt's final hidden states ("last" or "mean");
    # None: the checkpoint's own choice (sentence-transformers' pooling config), else "last".
    pooling: str | None = None

    def __post_init__(self) -> None:
        if self.prefill_step_ms is not None and not self.prefill_step_ms > 0:
            raise InvalidRequestError(f"prefill_step_ms must be > 0 (or inf: no pace); got "
                                      f"{self.prefill_step_ms}", param="prefill_step_ms")
        # The scheduling settings are checked where they are declared, as a CPU would run them.
        self.scheduler_config(max_model_len=_SCHEDULER.max_model_len, kv_window=0, device_type="cpu")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                                      f"got {self.kv_cache_dtype!r}", param="kv_cache_dtype")
        if self.task not in TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}",
                                      param="task")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_METHODS)}; "
                                      f"got {self.pooling!r}", param="pooling")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise InvalidRequestError(f"tensor_parallel_size must be an integer of at least 1; got "
                                      f"{self.tensor_parallel_size!r}", param="tensor_parallel_size")

    def scheduler_config(self, *, max_model_len: int, kv_window: int, device_type: str) -> SchedulerConfig:
        """The scheduler's settings for a model of `max_model_len` and `kv_window` on a device
        of `device_type`, whose defaults fill what this config leaves open (None)."""
        fair_share_rows = self.fair_share_rows
        if fair_share_rows is None:
            fair_share_rows = FAIR_SHARE_ROWS_DEFAULT.get(device_type, float("inf"))
        return dataclasses.replace(
            _SCHEDULER, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
            fair_share_rows=fair_share_rows, long_prefill_token_threshold=self.long_prefill_token_threshold,
            prefill_step_s=prefill_step_s(self.prefill_step_ms, device_type),
            scheduling_policy=self.scheduling_policy, kv_window=kv_window)
