"""The draft model of speculative decoding (`speculative_method="draft"`): a small model with the
target's vocabulary proposes K tokens per drafting request, greedily, from its own KV cache.

Owns: the draft model, its KV cache and block pool, and each drafting request's place in them
(`DraftSequence`: its blocks, how many of its tokens have K/V there, what it fed last time).
Refuses: any say in what is emitted. The target verifies the drafts exactly as it verifies
prompt lookup's (`spec_decode`), so a bad draft costs a rejected row, never a changed token.

How one proposal runs, for all drafting requests at once (K forwards of the draft model):
round 0 computes each request's tokens the draft cache lacks (a prefill chunk the first time,
then usually the tokens the last verification emitted) and picks the argmax after its newest
token; rounds 1 .. K-1 feed that pick back as a one-row decode, read from the device (the
model runner's pending-token path: no readback between rounds). The K picks per request stay
on the device (`DeviceDrafts`): the scheduler needs only how many there are, the verification
step's input rows are filled from them on the device, and they come back to the host in the
verification's own readback, beside the tokens they are checked against (one readback a step).
The verification then tells each sequence which drafts it fed (`confirm`); the draft cache is
valid as far as those were accepted, and the next proposal recomputes from there.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.model_runner import DeviceDrafts, ModelRunner
from nanoserve.engine.output import TokenBatch
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import ScheduledChunk
from nanoserve.engine.spec_decode import accepted_prefix
from nanoserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(slots=True)
class DraftSequence:
    """One request's tokens as the draft model holds them.

    `view` shares the request's prompt and output lists (no copy) and holds the draft pool's
    blocks; `view.num_computed_tokens` counts the tokens whose draft K/V are right.
    `fed_from` is the position of the drafts the last proposal fed to the draft model (all but
    its last pick; None: nothing fed since the last catch-up), `num_fed` how many, and `fed`
    their values as far as the verification read them back (`DraftModel.confirm`): only those
    can be checked against what the request kept, so only those can stay valid.
    """

    view: Request
    fed_from: int | None = None
    num_fed: int = 0
    fed: tuple[int, ...] = ()

    def catch_up(self, request: Request) -> None:
        """Trust the draft K/V only as far as the fed drafts match the request's tokens now."""
        view = self.view
        view.prompt_ids, view.output_ids = request.prompt_ids, request.output_ids
        if self.fed_from is not None:
            kept = request.token_ids(self.fed_from, self.fed_from + len(self.fed))
            valid = self.fed_from + accepted_prefix(self.fed, kept)
            view.num_computed_tokens = min(view.num_computed_tokens, valid)
        view.num_computed_tokens = min(view.num_computed_tokens, request.num_tokens - 1)
        self.fed_from, self.num_fed, self.fed = None, 0, ()


class DraftModel:
    def __init__(self, runner: ModelRunner, pool: BlockPool) -> None:
        self.runner = runner
        self.pool = pool
        self.sequences: dict[str, DraftSequence] = {}

    @property
    def vocab_size(self) -> int:
        return self.runner.model.config.vocab_size

    def propose(self, requests: list[Request], k: int) -> DeviceDrafts | None:
        """`k` greedy drafts for each request, on the device (none for a request the draft pool
        has no room for: drafts never wait or preempt); no readback."""
        if k == 0:
            return None
        views = [view for view in (self._view(request, k) for request in requests) if view is not None]
        if not views:
            return None
        chunks = [ScheduledChunk(v, v.num_computed_tokens, v.num_uncomputed_tokens) for v in views]
        tokens = self._round(chunks, None)
        by_id = {view.request_id: view for view in views}
        order = [by_id[request_id] for request_id in tokens.request_ids]  # the rows' order
        picks = [tokens.sampled.token_ids]
        for r in range(1, k):
            for view in order:
                view.num_pending_tokens = r  # the picks so far, on the device
            tokens = self._round([ScheduledChunk(v, v.num_tokens - 1, 1) for v in order], tokens)
            picks.append(tokens.sampled.token_ids)
        for view in order:
            self._fed(view, k)
        return DeviceDrafts(torch.stack(picks, dim=1), [view.request_id for view in order])

    def confirm(self, request_id: str, drafts: list[int]) -> None:
        """The verification read back `drafts`, the first of the request's proposal: those the
        draft model was fed can now be checked at the next catch-up."""
        sequence = self.sequences.get(request_id)
        if sequence is not None and sequence.fed_from is not None:
            sequence.fed = tuple(drafts[:sequence.num_fed])

    def release(self, live: Collection[str]) -> None:
        """Free the draft blocks of every request no longer live."""
        for request_id in [rid for rid in self.sequences if rid not in live]:
            self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self.pool.free(self.sequences.pop(request_id).view.block_ids)

    def _round(self, chunks: list[ScheduledChunk], in_flight: TokenBatch | None) -> TokenBatch:
        prepared = self.runner.prepare(chunks, in_flight)
        return self.runner.sample(self.runner.forward(prepared), prepared)

    def _view(self, request: Request, k: int) -> Request | None:
        """The request's draft view, caught up and with blocks for its tokens and k - 1 fed
        drafts; None when the pool has no room."""
        sequence = self.sequences.get(request.request_id)
        if sequence is not None and sequence.view.prompt_ids is not request.prompt_ids:
            self._drop(request.request_id)  # an id reused by a new request: nothing of it is valid
            sequence = None
        if sequence is None:
            view = Request(request.request_id, request.prompt_ids, GREEDY, 0, output_ids=request.output_ids)
            sequence = self.sequences[request.request_id] = DraftSequence(view)
        sequence.catch_up(request)
        view = sequence.view
        missing = self.pool.blocks_for_tokens(request.num_tokens + k - 1) - len(view.block_ids)
        if missing > 0:
            if not self.pool.can_allocate(missing):
                return None
            view.block_ids.extend(self.pool.allocate(missing))
        return view

    def _fed(self, view: Request, k: int) -> None:
        """After a proposal: K/V computed for the newest token and the first k - 1 drafts."""
        sequence = self.sequences[view.request_id]
        view.num_pending_tokens = 0
        sequence.fed_from, sequence.num_fed, sequence.fed = view.num_tokens, k - 1, ()
        view.num_computed_tokens = view.num_tokens + k - 1
