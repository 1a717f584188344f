"""How many prompt tokens one step may compute, from what the engine's own prefill steps cost.

Plain Python over numbers (no torch); the engine reports each step, the scheduler asks.

Why: a step cannot be interrupted, so a request that arrives while a long prompt prefills alone
waits for the step in flight, however the scheduler treats it afterwards. A lone prompt may use
the whole step budget (`max_num_batched_tokens`, 512 tokens) only if that step is short; on a
2-core CPU it is over a second. So every prefill step is paced to about `step_s` seconds: the
pace measures the seconds a prompt *unit* costs (`step_cost`'s row unit: a token attending over
C earlier tokens is 1 + C / context_tokens_per_row units, so a chunk deep into a long prompt gets
fewer tokens for the same time) and grants the tokens whose units fit in `step_s`, less the
units of the rows beside them (a lone client's own decode rows, at the same rate: in one step
they are rows of the same matrix multiplies). The grant never falls below `min_tokens`, a
floor in tokens, so it stays small: deep in a long prompt a token costs several units, and a
floor of many tokens there would be a long step again (results/README.md, "No request behind
another client's prefill", has the command that measures what the pace costs a lone prompt).

Measured, not assumed: only steps that compute prompt tokens and nothing else (a lone prefill)
are observed, so a decode row's cost never counts as a prompt's; the estimate is a moving
average, so it follows the machine (a busy neighbour process, a different model) within a few
steps. Before the first such step nothing is known, and the grant is `min_tokens`: one short
step, which measures. Where a chunk ends never changes a token (batch invariance), so pacing
changes only when tokens are computed, never what they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanoserve.engine.step_cost import PROFILED, StepCost


@dataclass(slots=True)
class PrefillPace:
    step_s: float  # the time a prefill step should take
    min_tokens: int  # the smallest grant: below it a step's overhead costs a lone prompt its speed
    cost: StepCost = PROFILED
    weight: float = 0.25  # of the newest observation in the moving average
    s_per_unit: float | None = None  # measured seconds per prompt unit; None: nothing measured yet

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ValueError(f"step_s must be > 0, got {self.step_s}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")

    def chunk_units(self, start: int, num_tokens: int) -> float:
        """Prompt units of tokens start .. start + num_tokens: each attends over its position."""
        return self.cost.units(num_tokens, start + num_tokens / 2)

    def observe(self, chunks: list[tuple[int, int]], step_s: float) -> None:
        """A step that computed these prompt chunks, (start, num_tokens) each, and nothing else,
        in `step_s` seconds."""
        units = sum(self.chunk_units(start, num_tokens) for start, num_tokens in chunks)
        if units <= 0 or step_s <= 0:
            return
        measured = step_s / units
        self.s_per_unit = measured if self.s_per_unit is None else (
            (1 - self.weight) * self.s_per_unit + self.weight * measured)

    def tokens(self, start: int, reserved_units: float = 0.0) -> int:
        """The prompt tokens from position `start` that one step computes in about `step_s`,
        beside `reserved_units` of rows that are not this prompt's (the step's decode rows)."""
        if self.s_per_unit is None:
            return self.min_tokens
        # n (1 + (start + n / 2) / C) = U, solved for n: n^2 / 2C + n (1 + start / C) - U = 0.
        units = max(0.0, self.step_s / self.s_per_unit - reserved_units)
        context = self.cost.context_tokens_per_row
        linear = 1 + start / context
        tokens = context * (math.sqrt(linear * linear + 2 * units / context) - linear)
        return max(self.min_tokens, int(tokens))
