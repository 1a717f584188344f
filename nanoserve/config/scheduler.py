"""What the scheduler runs with (`SchedulerConfig`): every scheduling setting's one default and
the one check of its value, and the per-device defaults the engine resolves before it builds it.

Refuses: scheduling itself (`nanoserve.engine.scheduler`) and measuring anything: the
per-device defaults below are figures taken elsewhere (results/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.errors import InvalidRequestError

SCHEDULING_POLICIES = ("fcfs", "priority")
# An arriving prompt up to this long prefills in one step while others decode (a one-off cost;
# the fair share leaves it alone), a longer one in chunks of its fair share.
MAX_PREFILL_TOKENS_WHILE_DECODING = 64
# The prefill pace's floor in tokens a step: deep in a long prompt, where a token costs several
# units, a paced step stays short too (results/README.md, "No request behind another client's
# prefill": what both cost a lone prompt, and the command).
PREFILL_PACE_MIN_TOKENS = 16
# Deferred output (EngineConfig.async_scheduling=None) per device type: off everywhere until a
# side-by-side measurement shows it pays there; the one place to flip it.
ASYNC_SCHEDULING_DEFAULT: dict[str, bool] = {"cpu": False, "cuda": False}
# The fair share (EngineConfig.fair_share_rows=None) per device type: on CPU a step's cost grows
# with every row (fair_share.py), and 2 extra row units bound one heavy request's slowdown of a
# one-row decode to ~1.8x (results/neighbours.csv); on CUDA rows are nearly free until the
# batch is large, and no GPU has measured it: off.
FAIR_SHARE_ROWS_DEFAULT: dict[str, float] = {"cpu": 2.0, "cuda": float("inf")}
# The prefill pace (EngineConfig.prefill_step_ms=None) per device type: on CPU a step no one
# shares computes the prompt tokens its measured cost fits in this many ms beside its own
# decode rows (an arrival waits for the step in flight, and an ordinary request's whole life
# is a few of them), at least PREFILL_PACE_MIN_TOKENS a step; on CUDA a 512-token step is
# short: no pace.
PREFILL_STEP_MS_DEFAULT: dict[str, float | None] = {"cpu": 50.0, "cuda": None}


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's settings, resolved: no field here depends on the device."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    # Reuse the K/V of prompt prefixes already computed (automatic prefix caching).
    enable_prefix_caching: bool = True
    # While any request decodes, a step computes at most this many prompt tokens; a prompt
    # longer than that prefills in chunks of its fair share (fair_share.py; results/README.md).
    # None: no bound but the step's.
    max_prefill_tokens_while_decoding: int | None = MAX_PREFILL_TOKENS_WHILE_DECODING
    # Row units a parent may take in a step beyond the lightest running parent's (fair_share.py);
    # inf: no fair share.
    fair_share_rows: float = float("inf")
    # Most prompt tokens of one request in a step (vLLM's --long-prefill-token-threshold): a
    # longer prompt is computed in chunks of at most this; None: no bound but the budgets'.
    long_prefill_token_threshold: int | None = None
    # A step no one shares computes the prompt tokens that its measured pace fits in about this
    # many seconds (prefill_pace.py), at least prefill_pace_min_tokens; None: no pace.
    prefill_step_s: float | None = None
    prefill_pace_min_tokens: int = PREFILL_PACE_MIN_TOKENS
    # Which waiting request runs first and which running one is preempted first (vLLM's
    # --scheduling-policy): "fcfs" by arrival, "priority" by the lowest
    # `SamplingParams.priority`, then arrival, in the waiting queue, the running order and
    # preemption.
    scheduling_policy: str = "fcfs"
    # Every layer of the model attends to only its last kv_window positions (Mistral-style
    # sliding windows): blocks wholly before them go back to the pool as a request advances.
    # 0: a request keeps every block (some layer sees the whole context).
    kv_window: int = 0
    # Most distinct LoRA adapters among the running requests, so in any step (the engine's
    # max_loras when LoRA is on); None: no bound. Base-model requests take no adapter slot.
    max_running_adapters: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "prefill_pace_min_tokens"):
            _at_least_one(name, getattr(self, name))
        for name in ("max_prefill_tokens_while_decoding", "long_prefill_token_threshold"):
            if getattr(self, name) is not None:
                _at_least_one(name, getattr(self, name))
        if self.prefill_step_s is not None and not self.prefill_step_s > 0:
            raise InvalidRequestError(f"prefill_step_s must be > 0 (or None: no pace); got "
                                      f"{self.prefill_step_s}", param="prefill_step_s")
        if not self.fair_share_rows >= 0:
            raise InvalidRequestError(f"fair_share_rows must be >= 0 (or inf: off); got "
                                      f"{self.fair_share_rows}", param="fair_share_rows")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequestError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                                      f"got {self.scheduling_policy!r}", param="scheduling_policy")
        if self.max_running_adapters is not None and self.max_running_adapters < 1:
            raise InvalidRequestError(f"max_running_adapters must be >= 1 (or None: no bound); got "
                                      f"{self.max_running_adapters}", param="max_loras")


def _at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise InvalidRequestError(f"{name} must be >= 1; got {value}", param=name)


def resolve_prefill_step_s(step_ms: float | None, device_type: str) -> float | None:
    """The prefill pace's step time in seconds (None: no pace): `step_ms`, else the device's default."""
    if step_ms is None:
        step_ms = PREFILL_STEP_MS_DEFAULT.get(device_type)
    return None if step_ms is None or step_ms == float("inf") else step_ms / 1e3


def resolve_fair_share_rows(rows: float | None, device_type: str) -> float:
    """The fair share's row units (inf: off): `rows`, else the device's default."""
    return rows if rows is not None else FAIR_SHARE_ROWS_DEFAULT.get(device_type, float("inf"))
