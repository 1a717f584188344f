"""One request's state as it moves through the engine. Plain Python: no torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.output import OutputState
    from nanoserve.sampler import RowEdits
    from nanoserve.structured import RowGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass(slots=True, eq=False)
class Request:
    """Token ids so far, how many of them have K/V in the cache, and the blocks holding it.

    `num_computed_tokens` counts tokens whose K/V sit in the cache. The newest sampled token
    is never computed yet: the next step feeds it to the model. `output_state` is the text
    side (detokenizer, stop-string matcher), `sampler_edits` the sampler's (its penalty
    and logit_bias cells on the device) and `grammar` the structured-output matcher, so a live
    request's state is all in one place and goes when the request does.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_s: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of full blocks so far
    output_state: OutputState | None = None
    sampler_edits: RowEdits | None = None  # penalty and logit_bias cells, built once per request
    grammar: RowGrammar | None = None  # the structured-output matcher of a constrained request

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids in [start, stop) across prompt and output."""
        num_prompt = len(self.prompt_ids)
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - num_prompt]
