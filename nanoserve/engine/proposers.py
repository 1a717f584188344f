"""Where a step's drafts come from: one interface, two proposers.

The engine asks once a step, before scheduling: `Drafter.propose(running)` sets each decoding
request's `draft_ids` for this step (an empty list: none) and returns the draft model's
proposal when it stays on the device. The choice of how many drafts each request carries is
`SpecConfig.allot`'s, the same for both proposers; a proposer only says how many drafts a
request could carry (`limit`), then makes them (`fill`):

- `NgramProposer`: prompt lookup over the request's own tokens (`spec_decode.DraftState`); its
  drafts are known on the host before the step.
- `DraftModelProposer`: the draft model's K greedy forwards (`worker.draft_model`); its drafts
  stay on the device (`ON_DEVICE` ids) until the verification's readback, where the engine
  `confirm`s them.

Refuses drafts for a request with a grammar (a draft row would need the grammar's state after
the drafts before it), and, with a draft model, for one whose sampling reads its output's
values (a penalty or bad word would read drafts the host has not seen) or whose prompt holds an
image token outside the vocabulary (the draft model has no image rows to put there). A draft is
a token the model could sample: prompt lookup ends its drafts before an id outside the
vocabulary (an image's placeholder).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from nanoserve.engine.draft_model import DraftModel
from nanoserve.engine.model_runner import DeviceDrafts
from nanoserve.engine.request import Request
from nanoserve.engine.spec_decode import ON_DEVICE, DraftState, SpecConfig


class Proposer(Protocol):
    def eligible(self, request: Request) -> bool:
        """Whether `request` may ever draft with this proposer."""

    def limit(self, request: Request, state: DraftState, k: int) -> int:
        """How many drafts (at most k) `request` could carry this step; 0: it does not draft."""

    def fill(self, chosen: dict[str, tuple[Request, int]]) -> DeviceDrafts | None:
        """Set each chosen request's `draft_ids` to its count of drafts."""

    def confirm(self, request_id: str, draft_ids: tuple[int, ...]) -> None:
        """The drafts of a request as the verification's readback shows them."""

    def release(self, live: Mapping[str, Request]) -> None:
        """Drop what the proposer holds for requests no longer live."""


@dataclass(slots=True)
class NgramProposer:
    """Prompt lookup: drafts from the request's own earlier tokens."""

    vocab_size: int  # the model's: an id past it (an image's placeholder) is never a draft
    lookups: dict[str, list[int]] = field(default_factory=dict)  # this step's, by request id

    def eligible(self, request: Request) -> bool:
        return request.grammar is None and not request.params.carries_draw_state

    def limit(self, request: Request, state: DraftState, k: int) -> int:
        lookup = state.propose(request.token_ids(state.num_indexed, request.num_tokens), k)
        outside = next((i for i, token in enumerate(lookup) if token >= self.vocab_size), len(lookup))
        self.lookups[request.request_id] = lookup[:outside]
        return outside

    def fill(self, chosen: dict[str, tuple[Request, int]]) -> None:
        for request_id, (request, k) in chosen.items():
            request.draft_ids = self.lookups[request_id][:k]
        self.lookups.clear()

    def confirm(self, request_id: str, draft_ids: tuple[int, ...]) -> None:
        raise RuntimeError("prompt-lookup drafts are known on the host; none comes back to confirm")

    def release(self, live: Mapping[str, Request]) -> None:
        """Nothing is held past a step."""


@dataclass(slots=True)
class DraftModelProposer:
    """A smaller model's greedy drafts, all drafting requests in one proposal on the device."""

    model: DraftModel

    def eligible(self, request: Request) -> bool:
        return (request.grammar is None and not request.params.reads_output_values
                and not any(request.prompt_ids[image.positions[0]] >= self.model.vocab_size
                            for image in request.images))

    def limit(self, request: Request, state: DraftState, k: int) -> int:
        return k if state.ready() else 0

    def fill(self, chosen: dict[str, tuple[Request, int]]) -> DeviceDrafts | None:
        drafts = self.model.propose([request for request, _ in chosen.values()],
                                    max((k for _, k in chosen.values()), default=0))
        for request_id in drafts.request_ids if drafts is not None else ():
            request, k = chosen[request_id]
            request.draft_ids = [ON_DEVICE] * k
        return drafts

    def confirm(self, request_id: str, draft_ids: tuple[int, ...]) -> None:
        self.model.confirm(request_id, draft_ids)

    def release(self, live: Mapping[str, Request]) -> None:
        self.model.release(live)


@dataclass(slots=True)
class Drafter:
    """The step's drafts: which decoding requests draft, how many each, from its proposer."""

    spec: SpecConfig
    proposer: Proposer

    def propose(self, running: Iterable[Request]) -> DeviceDrafts | None:
        running = list(running)
        for request in running:
            request.draft_ids = []
        decoding = [request for request in running
                    if request.num_uncomputed_tokens == 1 and request.pooling is None]
        candidates = []
        for request in decoding:
            if not self.proposer.eligible(request):
                continue
            if request.draft_state is None:
                request.draft_state = DraftState.for_config(self.spec)
            limit = self.proposer.limit(request, request.draft_state, self.spec.num_tokens)
            if limit:
                candidates.append((request, limit))
            else:
                request.draft_state.idle()
        counts = self.spec.allot([(request.draft_state.acceptance, limit) for request, limit in candidates],
                                 len(decoding))
        chosen = {}
        for (request, _), k in zip(candidates, counts, strict=True):
            if k:
                chosen[request.request_id] = (request, k)
            else:
                request.draft_state.idle()
        return self.proposer.fill(chosen)
