"""One request's state as it moves through the engine, and `NewToken`, the record that moves it on.

Plain Python: no torch here. Every module that handles requests imports this one; it imports
none of them (the types it names for annotations only come from lower floors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.engine.sampler import RowEdits
    from nanoserve.engine.spec_decode import DraftState
    from nanoserve.engine.structured import RowGrammar
    from nanoserve.model.lora import Adapter
    from nanoserve.multimodal.inputs import ImageInput
    from nanoserve.tokenizer import IncrementalDetokenizer, StopStringMatcher


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


@dataclass(frozen=True, slots=True)
class NewToken:
    """A token sampled for a request this step, and how it ends the request (None: it goes on).

    Made by the output processor's stop rules, applied by `Scheduler.update_after_step`."""

    request_id: str
    token_id: int
    finish: RequestStatus | None = None


@dataclass(slots=True)
class OutputState:
    """A request's text state (kept on the request, built by the output processor): the
    detokenizer and the stop-string matcher."""

    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    stop_token_ids: frozenset[int]


@dataclass(slots=True, eq=False)
class Request:
    """Token ids so far, how many of them have K/V in the cache, and the blocks holding it.

    `num_computed_tokens` counts tokens whose K/V sit in the cache. The newest sampled token
    is never computed yet: the next step feeds it to the model. With deferred output the newest
    token may be pending: sampled on the device by a step whose tokens the host has not
    resolved yet (`num_pending_tokens`: 1, or 2 between the next step's launch and this one's
    resolution); it counts in `num_tokens` but not in `output_ids`, and the next step reads it
    from the device. `output_state` is the text
    side (detokenizer, stop-string matcher), `sampler_edits` the sampler's (its penalty and
    logit_bias cells on the device), `grammar` the structured-output matcher and `draft_state`
    the speculative proposer's, so a live
    request's state is all in one place and goes when the request does.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_s: float = field(default_factory=time.monotonic)
    # The client request this one belongs to (an HTTP request's prompts and n choices share it);
    # None: its own.
    # The scheduler's fair share (fair_share.py) divides steps between parents.
    parent_id: str | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0  # sampled on the device, not yet appended to output_ids
    block_ids: list[int] = field(default_factory=list)
    # The first this many of block_ids went back to the pool: wholly outside the sliding window
    # of a model whose every layer slides (SchedulerConfig.kv_window). Their ids stay in the
    # table, so positions still index it; attention never reads them unmasked.
    num_released_blocks: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of full blocks so far
    output_state: OutputState | None = None
    sampler_edits: RowEdits | None = None  # penalty and logit_bias cells, built once per request
    # Speculative decoding: the drafts proposed to follow the newest token (the scheduler takes
    # what its budget allows), and the proposer's own state (n-gram index, back-off).
    draft_ids: list[int] = field(default_factory=list)
    draft_state: DraftState | None = None
    grammar: RowGrammar | None = None  # the structured-output matcher of a constrained request
    # prompt_logprobs: entry p (an output.TokenLogprob) scores prompt token p; entry 0 stays None
    # (nothing comes before it), and so does an image's placeholder outside the vocabulary. Filled
    # as prefill chunks compute them, handed out with the first output. Untyped here: output
    # imports this module, not the other way round.
    prompt_logprobs: list | None = None
    adapter: Adapter | None = None  # the LoRA adapter it runs with; None: the base model
    # An embedding request (its method resolved by the engine): prefill only, then one pooled
    # vector and done; nothing is sampled. Mean pooling keeps each chunk's final hidden rows (on
    # the device, untyped here: no torch) until the last chunk, then averages them at once, so
    # where the chunks ended never changes a bit.
    pooling: PoolingParams | None = None
    pooled_rows: list = field(default_factory=list)
    # A vision-language prompt's images: each one's embedding rows replace the token embeddings
    # at its prompt positions (the runner splices them), and its hash is in the prefix-cache key
    # of every block those positions fall in.
    images: list[ImageInput] = field(default_factory=list)

    @property
    def adapter_key(self) -> str | None:
        """The prefix cache's namespace for its adapter: K/V computed with one adapter is never
        another's (nor the base model's)."""
        return None if self.adapter is None else self.adapter.cache_key

    @property
    def parent(self) -> str:
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill still owes prompt logprobs (asked for, first output not out yet):
        then every prompt position needs logits, so none may come from the prefix cache."""
        return self.prompt_logprobs is not None and not self.output_ids

    @property
    def reads_every_position(self) -> bool:
        """Whether its prefill needs every prompt position computed (prompt logprobs owed, or mean
        pooling): then none may come from the prefix cache."""
        return self.scores_prompt or (self.pooling is not None and self.pooling.reads_every_position)

    def image_key_material(self, start: int, stop: int) -> bytes:
        """The hashes of its images with rows in positions [start, stop): a prefix-cache block's
        key over those positions mixes them in, so only the same images share the block."""
        return b"".join(image.key_material(start, stop) for image in self.images)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids in [start, stop) across prompt and output (a pending token is not there)."""
        num_prompt = len(self.prompt_ids)
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - num_prompt]
