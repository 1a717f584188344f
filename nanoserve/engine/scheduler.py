"""The scheduler: which requests run this step, and how many tokens of each.

Plain Python over integers (no torch), so every rule is testable in isolation.

Policy, in order, each step:
1. Running requests first, oldest first: each gets its remaining uncomputed tokens (one for a
   decode, a chunk for a prefill) as long as the token budget lasts. When the pool has no block
   for one of them, the newest running request is preempted by recompute: its blocks are freed,
   its tokens kept, and it goes back to the front of the waiting queue.
2. Then waiting requests, first come first served, while the budget, `max_num_seqs` and the
   free blocks allow. A long prompt is split across steps (chunked prefill), so it never
   stalls the decodes already running. Nothing is admitted in a step that preempted.

While any running request is decoding (one token to compute), the prefill chunks of a step
(every request with more than one token to compute: prompts, and recomputes after preemption)
share at most `max_prefill_tokens_while_decoding` tokens, oldest first, on top of the decodes.
A decode step then costs at most a plain one plus that many prompt tokens, however long the
prompts that arrive (vLLM bounds the same with `long_prefill_token_threshold` per prompt and
`max_num_partial_prefills` prompts). With nothing decoding, prefills take the whole budget.
Where a chunk ends never changes a token: a prompt in chunks computes what it would in one.
A bidirectional image (Gemma 3: its rows see the whole image) is never cut: a chunk that would
end inside one ends before it, and the chunk that reaches it takes it whole (`whole_images`).
   With prefix caching, a request being admitted first takes the longest run of cached full
   blocks its tokens start with (never all of them: the last token is always computed, so the
   step yields logits) and is scheduled from there. A preempted request re-admits the same way.
   With a disk tier (`ColdBlocks`: `--prefix-cache-dir`), the run continues from disk where
   memory's ends: each further block found there is read into a free block and registered, as
   long as blocks are free, instead of computed.

With LoRA adapters, the running requests hold at most `max_loras` distinct adapters, so no
step holds more (`AdapterSlots`): a waiting request whose adapter finds no slot is passed over,
never refused, and later requests with adapters wait behind it, so it is admitted once the
running adapters' requests finish; base-model requests take no slot.

While requests of more than one client request (a parent: an HTTP request's prompts and
choices, or a tenant's requests) run and one decodes, each parent takes at most its fair share
of a step's rows (`fair_share.py`: the lightest parent's demand plus `fair_share_rows`), its
requests least advanced first, so one request with many choices, a long context or a long
prompt slows the others by a bounded factor; an arriving prompt that fits whole in the prefill
budget, and in `max_prefill_tokens_while_decoding`, is exempt (a one-off cost), unless its
parent already runs and someone decodes (a client's further prompts are its steady work). A
request its parent's share holds back lets the ones behind it in the queue pass.

With the fair share on, a step is *contended* when more than one parent is running or waiting,
and then no one waits behind another client's prefill:
- the fair share holds even if nothing decodes yet, with a waiting parent's next prompt among
  the demands and each parent's prefill demand its slice of the prefill budget (split between
  the parents with prompt work), except that a prompt the step admits whole (an arrival's
  one-off) demands what its first decode row will, so the running parents are held to that
  share already in the step that computes the arrival's prompt; with nothing decoding that budget is
  `max_prefill_tokens_while_decoding` for each such parent. So an arrival beside a long prompt
  that was prefilling alone is admitted at once, in a short step, and two long prompts take
  turns rather than one waiting for the other;
- waiting requests are admitted round-robin by parent, the parents with the fewest running
  requests first, rather than first come first served behind one client's many prompts;
- when every slot (`max_num_seqs`) is taken and a parent with nothing running waits, the
  newest request of the parent holding the most slots is preempted to give it one.
A step no one shares is paced: since a step cannot be interrupted, an arrival waits for the
one in flight, so a step of one parent (a long prompt alone, or one request's n=16 prompts
admitted beside its own first decodes) computes the prompt tokens its measured cost fits in
about `prefill_step_s` beside its decode rows (`prefill_pace.py`; the engine reports each
prefill-only step's time), never fewer than `prefill_pace_min_tokens`. vLLM's
`long_prefill_token_threshold` caps one request's chunk in every step.

With speculation, a decoding request also carries the drafts the engine proposed for it
(`Request.draft_ids`), as many as the spare budget and its max_tokens allow, as extra rows of
its chunk; when the pool has no room for them it decodes plainly instead (drafts never preempt).

After the step, `update_after_step` is the one place request state moves on: each new token is
appended, computed tokens advance (a chunk's drafts only as far as its run accepted them),
blocks a step filled with computed tokens are registered in the prefix cache, blocks that only
rejected drafts reached are freed, so are blocks wholly outside the window of a model whose
every layer slides (`kv_window`: they stay in the prefix cache), and requests the stop rules
ended are finished. The scheduler's `requests` is the one registry of live requests; `waiting`
and `running` order them.

Deferred output splits that update in two. `commit(plan)`, when the engine launches a step it
will resolve one step late, counts the planned tokens as computed at once and marks each
sampling chunk's newest token pending (`Request.num_pending_tokens`: on the device, value
unknown here); so the next `schedule` sees a decode to run for it, from the device. The
step's `update_after_step` later appends the values. A request whose pending token is its
last (max_tokens) is not scheduled again; one that a pending token ends otherwise (a stop
token or string) runs one step too many, and the engine discards that overshoot row.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from nanoserve.config.scheduler import SchedulerConfig
from nanoserve.engine.admission import check_fits, request_token_limit
from nanoserve.engine.block_pool import BlockPool, block_keys, chain_root
from nanoserve.engine.fair_share import FairShare
from nanoserve.engine.prefill_pace import PrefillPace
from nanoserve.engine.request import NewToken, Request, RequestStatus


class ColdBlocks(Protocol):
    """Full blocks kept outside the pool, by prefix-cache key (`engine.prefix_store`)."""

    def has(self, key: bytes) -> bool: ...

    def load(self, key: bytes, block_id: int) -> bool:
        """Put block `key` into pool block `block_id`; False when it cannot (then nothing changed)."""
        ...


def priority_key(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return request.params.priority, request.arrival_s


@dataclass(slots=True)
class AdapterSlots:
    """The LoRA adapters of the running requests, at most `max_loras` (None: no bound) distinct
    ones: every step schedules only running requests, so no step holds more.

    An adapter that finds every slot taken waits until one frees: its requests are passed over
    and, from the first of them in the waiting order, so is every later request with an
    adapter, so the running adapters' newer requests cannot keep their slots for ever; the
    running ones finish (max_tokens bounds them) and the waiting adapter is admitted in a
    bounded number of steps. Base-model requests take no slot and are never held back."""

    max_loras: int | None
    running: set[str]
    blocked: bool = False

    @classmethod
    def of(cls, max_loras: int | None, running: Iterable[Request]) -> AdapterSlots:
        return cls(max_loras, {r.adapter_key for r in running if r.adapter_key is not None})

    def admits(self, request: Request) -> bool:
        key = request.adapter_key
        if key is None or self.max_loras is None:
            return True
        if self.blocked or (key not in self.running and len(self.running) >= self.max_loras):
            self.blocked = True
            return False
        return True

    def take(self, request: Request) -> None:
        if request.adapter_key is not None:
            self.running.add(request.adapter_key)


def whole_images(request: Request, start: int, num_tokens: int, step_tokens: int) -> int:
    """The tokens of a chunk from `start` once no bidirectional image is cut: its rows attend up
    to the image's last position, so the chunk computing them must hold the rest of it. A chunk
    that would end inside such an image ends before it (vLLM's rule for bidirectional images);
    one that starts at or inside it takes it whole, past the prefill caps and the fair share,
    if what is left of the step's `step_tokens` holds it, else none this step. (The engine
    refuses a model whose image is longer than max_num_batched_tokens, so it fits some step.)
    A chunk granted nothing stays nothing."""
    if num_tokens == 0:
        return 0
    stop = start + num_tokens
    for image in request.images:
        first, last = image.positions[0], image.last_position
        if image.bidirectional and first < stop <= last:
            whole = last + 1 if last + 1 - start <= step_tokens else start
            stop = first if first > start else whole
            break
    return stop - start


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at position `start`, computed this step.

    With speculation, the last `len(draft_ids)` of them are drafts that follow the request's
    newest token: the chunk then yields one sampled row per draft plus one.
    """

    request: Request
    start: int
    num_tokens: int
    draft_ids: tuple[int, ...] = ()
    # Whether this chunk reaches the newest token, so its last row yields a new token (fixed
    # when scheduled: a committed step's request grows before the step is resolved); for an
    # embedding request, whether it completes the prompt, so the step pools its vector instead.
    samples: bool = field(init=False, default=False)
    pools: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        reaches = self.start + self.num_tokens - len(self.draft_ids) == self.request.num_tokens
        embeds = self.request.pooling is not None
        object.__setattr__(self, "samples", reaches and not embeds)
        object.__setattr__(self, "pools", reaches and embeds)

    @property
    def is_decode(self) -> bool:
        """One known token (the newest), with or without drafts behind it."""
        return self.num_tokens - len(self.draft_ids) == 1


@dataclass(slots=True)
class StepBudget:
    """What one step may still compute: tokens in all, and of those, prefill tokens."""

    tokens: int
    prefill_tokens: int
    decoding: bool = False  # some running request decodes this step
    contended: bool = False  # the fair share is on and more than one parent runs or waits
    # A parent's slice of the prefill budget, fixed at the step's start: all of it, or in a
    # contended step its part among the parents with prompt work.
    slice_tokens: int = 0

    @property
    def shared(self) -> bool:
        """Whether the prefill budget and the fair share hold this step."""
        return self.decoding or self.contended

    def grant(self, request: Request) -> int:
        """How many of the request's uncomputed tokens fit: a decode (one token) needs only the
        step's budget, a prefill chunk the prefill budget too."""
        wanted = request.num_uncomputed_tokens
        return min(wanted, self.tokens if wanted == 1 else min(self.tokens, self.prefill_tokens))

    def spend(self, request: Request, num_tokens: int) -> None:
        self.tokens -= num_tokens
        if request.num_uncomputed_tokens > 1:  # an image taken whole may overdraw the prefill budget
            self.prefill_tokens = max(0, self.prefill_tokens - num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    committed: bool = False  # its computed tokens counted at launch (deferred output)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, cold: ColdBlocks | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cold = cold
        self.requests: dict[str, Request] = {}  # every live request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up in the cache
        self.prefix_cache_hits = 0  # of those, tokens the cache supplied
        self.share = FairShare(config.fair_share_rows)
        self.pace = (PrefillPace(config.prefill_step_s, config.prefill_pace_min_tokens)
                     if config.prefill_step_s is not None else None)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt plus output) one request may ever hold."""
        return request_token_limit(self.config.max_model_len, self.pool.num_blocks, self.pool.block_size)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Admission's length check (`admission.check_fits`) against this scheduler's limits."""
        check_fits(num_prompt_tokens, max_tokens, self.max_request_tokens)

    def add(self, request: Request) -> None:
        """Queue a request that passed `check_fits` (the caller's admission check) under a new id."""
        self.requests[request.request_id] = request
        self._enqueue(request, front=False)

    @property
    def by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def _enqueue(self, request: Request, *, front: bool) -> None:
        """Queue a request to wait: FCFS at the back (an arrival) or the front (a preempted one);
        by priority at its place in (priority, arrival) order, the queue's order throughout."""
        if not self.by_priority:
            self.waiting.appendleft(request) if front else self.waiting.append(request)
            return
        key = priority_key(request)
        place = next((i for i, other in enumerate(self.waiting) if priority_key(other) > key),
                     len(self.waiting))
        self.waiting.insert(place, request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        num_parents = len({r.parent for r in (*self.running, *self.waiting)})
        contended = self.share.enabled and num_parents > 1
        if contended:
            self._give_newcomers_slots(out)
        budget = self._step_budget(contended, lone=num_parents <= 1)
        self.share.begin_step(self._demands(budget) if self.share.enabled else {}, budget.shared)
        num_preempted = len(out.preempted)
        self._schedule_running(out, budget)
        if len(out.preempted) == num_preempted:  # no one was preempted for blocks
            self._admit_waiting(out, budget)
        self.share.end_step()
        return out

    def _step_budget(self, contended: bool, *, lone: bool) -> StepBudget:
        """While a request decodes, prompts share the prefill cap; in a contended step where
        none decodes yet, each parent with prompt work may have the cap's worth (so an arrival
        beside a long prompt waits one short step, and a burst of arrivals is not slowed).
        A step no other parent shares (`lone`: one parent, or none decoding with the fair share
        off) is paced: its prompt tokens and its own decode rows fit in about `prefill_step_s`,
        since whoever arrives next waits for it (a client's n=16 prompts admitted beside its
        first decodes, as much as a long prompt alone)."""
        tokens = self.config.max_num_batched_tokens
        cap = self.config.max_prefill_tokens_while_decoding
        decoding = any(request.num_uncomputed_tokens == 1 for request in self.running)
        budget = StepBudget(tokens, tokens, decoding, contended)
        if cap is not None and decoding:
            budget.prefill_tokens = min(tokens, cap)
        elif cap is not None and contended:
            budget.prefill_tokens = min(tokens, cap * len(self._prefilling_parents()))
        if self.pace is not None and not contended and (lone or not decoding):
            paced = self.pace.tokens(self._pace_context(), reserved_units=self._decode_units())
            budget.prefill_tokens = min(budget.prefill_tokens, paced)
        budget.slice_tokens = budget.prefill_tokens
        if contended:
            budget.slice_tokens = max(1, budget.prefill_tokens // max(1, len(self._prefilling_parents())))
        return budget

    def _decode_units(self) -> float:
        """The row units of the running decodes (their drafts and sampling included)."""
        return sum(self.share.units(1 + len(r.draft_ids), r.num_computed_tokens + 1, self._row_extra(r))
                   for r in self.running if r.num_uncomputed_tokens == 1)

    def _pace_context(self) -> int:
        """Where the step's first prompt chunk starts: the oldest running prefill's computed
        tokens (a long prompt deep into its context gets fewer tokens), else a new prompt's 0."""
        return next((r.num_computed_tokens for r in self.running if r.num_uncomputed_tokens > 1), 0)

    def _grant(self, budget: StepBudget, request: Request) -> int:
        """The step budget's grant, a prompt chunk at most `long_prefill_token_threshold`."""
        granted = budget.grant(request)
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None and request.num_uncomputed_tokens > 1:
            return min(granted, threshold)
        return granted

    def _prefilling_parents(self) -> set[str]:
        """The parents with prompt work this step: running prefills, and waiting parents' heads."""
        return ({r.parent for r in self.running if r.num_uncomputed_tokens > 1}
                | {r.parent for r in self._waiting_heads()})

    def _demands(self, budget: StepBudget) -> dict[str, float]:
        """The row units each parent would take this step with no fair share: the running ones,
        and in a contended step each waiting parent's next prompt; a prompt chunk counts at
        most the parent's slice of the prefill budget."""
        heads = self._waiting_heads() if budget.contended else []
        demands: dict[str, float] = {}
        for request in self.running:
            wanted = request.num_uncomputed_tokens
            tokens = 1 + len(request.draft_ids) if wanted == 1 else min(wanted, budget.slice_tokens)
            units = self.share.units(tokens, request.num_computed_tokens + tokens, self._row_extra(request))
            demands[request.parent] = demands.get(request.parent, 0.0) + units
        for request in heads:
            demands[request.parent] = self._arrival_demand(request, budget)
        return demands

    def _arrival_demand(self, request: Request, budget: StepBudget) -> float:
        """A waiting parent's demand: a prompt the step admits whole is an arrival's one-off, paid
        by no share, so the parent demands what its first decode row will, and the running
        parents are held to that share already in the step that admits it (not only from the
        next one: a heavy neighbour running whole beside an arrival's prompt would double its
        first token's time). A longer prompt demands its slice of the prefill budget."""
        if request.pooling is None and self._one_off(request, budget, self._grant(budget, request)):
            return self.share.units(1, request.num_tokens, self.share.cost.sampling_units(request.params))
        tokens = min(request.num_uncomputed_tokens, budget.slice_tokens)
        return self.share.units(tokens, request.num_computed_tokens + tokens)

    def _one_off(self, request: Request, budget: StepBudget, granted: int) -> bool:
        """Whether a step granting `granted` tokens computes the request's prompt whole, as an
        arrival's one-off no share pays for: all of it, and no longer than
        `max_prefill_tokens_while_decoding`, else than its parent's slice of the budget (a
        contended step's budget holds a part for each client with prompt work; one arrival's
        long prompt must not take the others')."""
        cap = self.config.max_prefill_tokens_while_decoding
        wanted = request.num_uncomputed_tokens
        return granted == wanted and wanted <= (cap if cap is not None else budget.slice_tokens)

    def _waiting_heads(self) -> list[Request]:
        """The first waiting request of each parent with nothing running."""
        running = {r.parent for r in self.running}
        heads: dict[str, Request] = {}
        for request in self.waiting:
            if request.parent not in running:
                heads.setdefault(request.parent, request)
        return list(heads.values())

    def _waiting_order(self, contended: bool) -> list[Request]:
        """First come first served; in a contended step round-robin by parent, the parents with
        the fewest running requests first (then by their first waiting request)."""
        if not contended:
            return list(self.waiting)
        by_parent: dict[str, list[Request]] = {}
        for request in self.waiting:
            by_parent.setdefault(request.parent, []).append(request)
        running = Counter(r.parent for r in self.running)
        queues = sorted(by_parent.values(), key=lambda queue: running[queue[0].parent])
        return [request for turn in itertools.zip_longest(*queues) for request in turn if request is not None]

    def _give_newcomers_slots(self, out: SchedulerOutput) -> None:
        """With every slot taken, preempt for each waiting parent with nothing running the
        newest request of the parent holding the most slots, if it holds more than one (by
        priority, among the least urgent requests, if they are no more urgent than the newcomer)."""
        for newcomer in self._waiting_heads():
            if len(self.running) < self.config.max_num_seqs or newcomer.num_pending_tokens:
                return
            yielding = self.running
            if self.by_priority:  # only the least urgent level gives up a slot, and not to a less urgent one
                least = max(r.params.priority for r in self.running)
                if least < newcomer.params.priority:
                    return
                yielding = [r for r in self.running if r.params.priority == least]
            holders = Counter(r.parent for r in yielding)
            parent, held = holders.most_common(1)[0]
            if held < 2:
                return
            self._preempt(next(r for r in reversed(yielding) if r.parent == parent), out)

    def _row_extra(self, request: Request) -> float:
        """What each of the request's rows costs the fair share beyond its model row: a decode
        row (and each draft) samples; a prompt chunk's rows, and an embedding request's, do not."""
        if request.num_uncomputed_tokens != 1 or request.pooling is not None:
            return 0.0
        return self.share.cost.sampling_units(request.params)

    def _running_order(self) -> list[Request]:
        """Oldest first; while sharing, each parent's requests together at its oldest one's place,
        least advanced first (stable), so the choices its share holds back take turns. By
        priority, that order within each priority level, the lowest level first."""
        order = self.running
        if self.share.active:
            by_parent: dict[str, list[Request]] = {}
            for request in self.running:
                by_parent.setdefault(request.parent, []).append(request)
            order = [request for group in by_parent.values()
                     for request in sorted(group, key=lambda request: request.num_tokens)]
        if self.by_priority:
            return sorted(order, key=lambda request: request.params.priority)  # stable
        return list(order)

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget) -> None:
        for request in self._running_order():
            if budget.tokens == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.num_pending_tokens and request.num_tokens >= request.max_total_tokens:
                continue  # its pending token is its last: max_tokens ends it when resolved
            start, extra = request.num_computed_tokens, self._row_extra(request)
            num_tokens = self.share.affordable(request.parent, start, self._grant(budget, request), extra)
            num_tokens = whole_images(request, start, num_tokens, budget.tokens)
            if num_tokens == 0:
                continue
            drafts = self._drafts(request, budget.tokens - num_tokens)
            drafts = drafts[:self.share.affordable(request.parent, start, num_tokens + len(drafts), extra,
                                                   optional=True) - num_tokens]
            if drafts and not self._reserve(request, start + num_tokens + len(drafts)):
                drafts = ()  # no room for them: decode plainly rather than preempt anyone
            if not self._reserve_or_preempt(request, num_tokens, out):
                continue
            out.chunks.append(ScheduledChunk(request, start, num_tokens + len(drafts), drafts))
            budget.spend(request, num_tokens + len(drafts))  # drafts ride on a decode: no prefill budget
            self.share.spend(request.parent, start, num_tokens + len(drafts), extra)

    def _drafts(self, request: Request, spare_budget: int) -> tuple[int, ...]:
        """The request's proposed drafts that fit: a decode only, within the spare budget, and
        never more than max_tokens leaves room for (a run emits at most drafts + 1 tokens)."""
        if not request.draft_ids or request.num_uncomputed_tokens != 1:
            return ()
        room = min(spare_budget, request.max_total_tokens - request.num_tokens - 1)
        return tuple(request.draft_ids[:max(0, room)])

    def _reserve_or_preempt(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make room for `num_tokens` more tokens of `request`, preempting the newest others that
        this step has not scheduled yet (a fair share's order may have scheduled newer ones); by
        priority, the one with the highest priority value first (the newest among equals)."""
        scheduled = None  # built at the first shortage only: most steps preempt no one
        while not self._reserve(request, request.num_computed_tokens + num_tokens):
            scheduled = scheduled or {id(chunk.request) for chunk in out.chunks}
            victim = self._victim(scheduled)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _victim(self, scheduled: set[int]) -> Request:
        candidates = [other for other in self.running if id(other) not in scheduled]
        if self.by_priority:
            return max(reversed(candidates), key=priority_key)  # reversed: the newest of equal keys
        return candidates[-1]

    def _admit_waiting(self, out: SchedulerOutput, budget: StepBudget) -> None:
        running_parents = Counter(request.parent for request in self.running)
        slots = AdapterSlots.of(self.config.max_running_adapters, self.running)
        for request in self._waiting_order(budget.contended):
            if budget.tokens == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if request.num_pending_tokens:
                break  # preempted with a token in flight: admitted once the token is known
            if not slots.admits(request):
                continue  # its adapter waits for a slot; base-model requests behind it may pass
            hits = self._take_cached_prefix(request)
            num_tokens = self._grant(budget, request)
            self.share.admit(request.parent, decoding=budget.shared,
                             others_running=bool(running_parents.keys() - {request.parent}))
            # An arrival whose prompt fits whole is a one-off, exempt from its share; a client's
            # further prompts (one request's many, a tenant's) are steady work while anyone decodes.
            whole = self._one_off(request, budget, num_tokens) and (
                request.parent not in running_parents or not budget.decoding)
            if not whole:
                num_tokens = self.share.affordable(request.parent, request.num_computed_tokens, num_tokens)
                if num_tokens == 0 and self._grant(budget, request) > 0:
                    self._unadmit(request)
                    continue  # its parent's share is spent this step: the next in line may run
            num_tokens = whole_images(request, request.num_computed_tokens, num_tokens, budget.tokens)
            if num_tokens == 0 or not self._reserve(request, request.num_computed_tokens + num_tokens):
                self._unadmit(request)
                break  # FCFS: no one overtakes the head of the queue for budget or blocks
            self._count_lookup(request, hits)
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            running_parents[request.parent] += 1
            slots.take(request)
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_tokens))
            budget.spend(request, num_tokens)
            if not whole:
                self.share.spend(request.parent, request.num_computed_tokens, num_tokens)

    def _unadmit(self, request: Request) -> None:
        """Give back the cached blocks a request that is not admitted after all took."""
        self._release(request)
        request.num_computed_tokens = 0

    def _take_cached_prefix(self, request: Request) -> int:
        """Give a request with nothing computed the cached blocks its tokens start with;
        how many tokens they hold. The last token is left out, so it is always computed (its
        logits, or its hidden state for last pooling). A request still owing prompt logprobs, or
        mean pooling, takes none (cached positions have no logits and no hidden states)."""
        if (not self.config.enable_prefix_caching or request.num_computed_tokens
                or request.reads_every_position):
            return 0
        keys = self._keys(request, (request.num_tokens - 1) // self.pool.block_size)
        hit_ids = self.pool.lookup(keys)
        self.pool.take(hit_ids)  # before any load: a load's allocation must not evict them
        if self.cold is not None:
            hit_ids += self._load_cold(keys[len(hit_ids):])
        request.block_ids = hit_ids
        request.num_computed_tokens = len(hit_ids) * self.pool.block_size
        return request.num_computed_tokens

    def _load_cold(self, keys: list[bytes]) -> list[int]:
        """The run of `keys` the disk tier holds, from the first, each read into a block of its
        own (held, registered), while blocks are free."""
        loaded: list[int] = []
        for key in keys:
            if not self.pool.can_allocate(1) or not self.cold.has(key):
                break
            block_id = self.pool.allocate(1)[0]
            if not self.cold.load(key, block_id):
                self.pool.free([block_id])
                break
            self.pool.register(block_id, key)
            loaded.append(block_id)
        return loaded

    def _count_lookup(self, request: Request, hits: int) -> None:
        if not self.config.enable_prefix_caching:
            return
        if request.num_preemptions == 0:
            request.num_cached_tokens = hits
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += hits

    def _keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """The prefix-cache keys of the request's first `num_blocks` full blocks (kept, since a
        request's tokens only grow)."""
        keys = request.block_keys
        if len(keys) < num_blocks:
            size = self.pool.block_size
            parent = keys[-1] if keys else chain_root(request.params.cache_salt, request.adapter_key)
            first = len(keys)
            tokens = request.token_ids(first * size, num_blocks * size)
            extra = ([request.image_key_material(b * size, (b + 1) * size) for b in range(first, num_blocks)]
                     if request.images else ())
            keys += block_keys(tokens, size, num_blocks - first, parent, extra)
        return keys[:num_blocks]

    def _register_filled_blocks(self, chunk: ScheduledChunk) -> None:
        """Offer the blocks this chunk filled with computed tokens to the prefix cache (a block
        still growing never, nor one holding a rejected draft's K/V)."""
        size = self.pool.block_size
        first, stop = chunk.start // size, chunk.request.num_computed_tokens // size
        if stop <= first:
            return
        keys = self._keys(chunk.request, stop)
        for index in range(first, stop):
            self.pool.register(chunk.request.block_ids[index], keys[index])

    def _roll_back_drafts(self, request: Request) -> None:
        """Free the blocks only rejected drafts reached; their slots in kept blocks are simply
        written again later (attention never reads past a row's own position)."""
        keep = self.pool.blocks_for_tokens(request.num_tokens)
        if len(request.block_ids) > keep:
            self.pool.free(request.block_ids[keep:])
            del request.block_ids[keep:]

    def _release_outside_window(self, chunk: ScheduledChunk) -> None:
        """Free the request's blocks that no later query can see: a query at position q sees
        keys after q - kv_window, and every later query (a step already launched ahead of this
        one's resolution included) sits at or past this chunk's accepted end."""
        request = chunk.request
        first_query = min(request.num_computed_tokens, chunk.start + chunk.num_tokens)
        unseen = max(0, first_query - self.config.kv_window + 1) // self.pool.block_size
        if unseen > request.num_released_blocks:
            self.pool.free(request.block_ids[request.num_released_blocks:unseen])
            request.num_released_blocks = unseen

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        missing = self.pool.blocks_for_tokens(num_tokens) - len(request.block_ids)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        request.block_ids.extend(self.pool.allocate(missing))
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)
        out.preempted.append(request)

    def _release(self, request: Request) -> None:
        self.pool.free(request.block_ids[request.num_released_blocks:])
        request.block_ids, request.num_released_blocks = [], 0

    def commit(self, plan: SchedulerOutput) -> None:
        """A step launched ahead of its resolution (deferred output, never with drafts): its
        planned tokens are computed from now on, and each sampling chunk's new token is pending
        until `update_after_step` brings its value."""
        if any(chunk.draft_ids for chunk in plan.chunks):
            raise ValueError("a step with speculative drafts is resolved before the next one")
        for chunk in plan.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
            chunk.request.num_pending_tokens += chunk.samples
        plan.committed = True

    def update_after_step(self, plan: SchedulerOutput, new_tokens: Iterable[NewToken]) -> None:
        """What a step changes in request state: each new token is appended to its request, the
        planned tokens are now computed (of a chunk's drafts, those its run accepted: every
        token it emitted but the last), and a request a new token ends is finished.

        For a committed plan the tokens were counted computed at launch, and each new token
        replaces its request's pending one; a request that was finished or preempted since
        (an overshoot row, already dropped by the engine) changes no further."""
        new_tokens = list(new_tokens)
        emitted = Counter(new.request_id for new in new_tokens)
        for new in new_tokens:
            request = self.requests[new.request_id]
            request.output_ids.append(new.token_id)
            request.num_pending_tokens -= plan.committed
        for chunk in plan.chunks:
            request = chunk.request
            accepted = max(0, emitted[request.request_id] - 1) if chunk.draft_ids else 0
            if not plan.committed:
                request.num_computed_tokens += chunk.num_tokens - len(chunk.draft_ids) + accepted
            if request.status.is_finished:
                continue
            if self.config.enable_prefix_caching:
                self._register_filled_blocks(chunk)
            if chunk.draft_ids:
                self._roll_back_drafts(request)
            if self.config.kv_window:
                self._release_outside_window(chunk)
        for new in new_tokens:
            if new.finish is not None:
                self.finish(self.requests[new.request_id], new.finish)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stopped, length or aborted) wherever it is; its blocks free at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = status
        del self.requests[request.request_id]
