"""Fair share of a step: no client request slows the ones beside it by more than a bounded factor.

Plain Python over numbers (no torch); the scheduler asks it how much of a step each request may take.

Why: on a CPU a step's cost grows with its rows from the first one (the quantized kernels are
compute-bound at one row) and with each row's attention context (`step_cost` models both). So a
request with n=16 choices, a long prompt or a long cached context would make every step of an
ordinary request beside it several times longer (results/neighbours.csv).

The unit is `step_cost`'s *row unit*: one computed token (a decode row, a draft, a prompt token) attending
over a short context; a token attending over C earlier tokens costs 1 + C / context_tokens_per_row
units, and a row that samples (not greedy) or reports top logprobs costs what the sampler's exact
path and the host's formatting add (`sampling_units`). Requests are grouped by *parent*, the
client request they belong to (an HTTP request with all its prompts and n choices, one
`LLM.generate` call). Model a step as a + b * units, and call the fixed part a / b the step's
fixed cost in units (about 3 in the profiled step cost). A parent p running beside the lightest
parent, of u units,
slows it by (a + b (u + u_p)) / (a + b u); so while more than one parent runs and some request
decodes, each parent takes at most u + extra_rows units a step, u the smallest demand among the
running parents. The lightest runs whole; equal requests (a plain crowd) are never held back,
since each demands what the lightest does; one heavy parent is held to a bounded slowdown of
the rest: with extra_rows = 2, 1 + (u + 2) / (3 + u), 1.75 for a one-row decode (u = 1) and
below 2 for any u.

- A parent's requests go least advanced first, so all its choices progress in turn.
- What a parent leaves unspent carries to the next step only up to the cost of the row that did
  not fit: a row that costs more than a step's share (a decode over a long context) runs every
  few steps instead of never, and no parent banks a share.
- An arriving prompt that fits whole in the step's prefill budget is computed at once: that is
  the one-off cost of an arrival, not the steady cost this bounds; a longer prompt is chunked
  to its share. Only a parent's first is an arrival: while anyone decodes, the further prompts
  of a parent already running (one request's 64 prompts x n=4) are its steady work, paid from
  its share like its decode rows. In the step that computes an arrival's prompt, the arrival
  demands what its first decode row will (the scheduler's `_arrival_demand`), so a heavy
  parent beside it is held to its share from that step on, not one step later: its whole n=16
  step beside the arrival's prompt was most of the arrival's extra time to its first token.
- A parent alone is never held back. A step where nothing decodes is shared only when another
  parent runs or waits (the scheduler's contended step: a waiting parent's next prompt is one
  of the demands, and each prompt's demand is its parent's slice of the prefill budget), so an
  arrival is not stuck behind a long prompt that was prefilling alone.

Which step computes a token never changes the token (batch invariance), so tokens and logprobs
are the same with the share on or off; only who waits changes, and the heavy request's own
throughput drops while it has neighbours. vLLM and SGLang bound prefill per step but not a
request's decode rows. A client that splits its work into many requests is one parent only
when the server knows it: `nanoserve serve` with more than one API key makes each tenant one
parent (server/tenants.py); otherwise each HTTP request is its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.engine.step_cost import PROFILED, StepCost


@dataclass(slots=True)
class FairShare:
    """Each parent's row units for the step being scheduled, and what carries to the next."""

    extra_rows: float
    cost: StepCost = PROFILED
    credit: dict[str, float] = field(default_factory=dict)  # units left this step, by parent
    blocked: dict[str, float] = field(default_factory=dict)  # cost of the row that did not fit
    lightest: float = 0.0  # the smallest demand among the parents running at the step's start
    active: bool = False

    @property
    def enabled(self) -> bool:
        """Whether any step may be shared (inf extra rows: never); SchedulerConfig checks the value."""
        return self.extra_rows != float("inf")

    def units(self, num_tokens: int, context: int, extra: float = 0.0) -> float:
        return self.cost.units(num_tokens, context, extra)

    def begin_step(self, demands: dict[str, float], decoding: bool) -> None:
        """Give each parent its share, from what each would take unbounded; `decoding`: whether
        the step is shared at all (some request decodes, or the scheduler finds it contended)."""
        self.lightest = min(demands.values(), default=0.0)
        self.active = decoding and len(demands) > 1 and self.enabled
        if not self.active:
            self.credit.clear()
            self.blocked.clear()
            return
        share = self.lightest + self.extra_rows
        self.credit = {parent: self.credit.get(parent, 0.0) + share for parent in demands}
        self.blocked = {}

    def admit(self, parent: str, *, others_running: bool, decoding: bool) -> None:
        """A parent arriving mid-step shares from now on if another parent runs and one decodes."""
        if others_running and decoding and self.enabled:
            self.active = True
            self.credit.setdefault(parent, self.lightest + self.extra_rows)

    def affordable(self, parent: str, start: int, wanted: int, extra: float = 0.0, *,
                   optional: bool = False) -> int:
        """How many of `wanted` tokens from position `start` the parent's share pays for now;
        `optional` tokens (drafts) that do not fit are simply left out, not waited for."""
        if not self.active or parent not in self.credit:
            return wanted
        left = self.credit[parent]
        granted = 0
        while granted < wanted and self.units(granted + 1, start + granted + 1, extra) <= left:
            granted += 1
        if granted < wanted and not optional:
            self.blocked.setdefault(parent, self.units(granted + 1, start + granted + 1, extra)
                                    - self.units(granted, start + granted, extra))
        return granted

    def spend(self, parent: str, start: int, num_tokens: int, extra: float = 0.0) -> None:
        if self.active and parent in self.credit:
            self.credit[parent] -= self.units(num_tokens, start + num_tokens, extra)

    def end_step(self) -> None:
        """Carry a blocked parent's unspent units, up to the row it waits for; no one else's."""
        if self.active:
            self.credit = {parent: min(left, self.blocked[parent])
                           for parent, left in self.credit.items() if parent in self.blocked}
