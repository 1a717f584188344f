"""What a step costs, by what it computes: the one model the scheduler's fair share and
speculation's draft count both read.

A step's forward time grows with its rows from the first one on a CPU (the quantized kernels
are compute-bound at one row), in whole groups of the integer kernels' row tile, and each row's
attention grows with its context; a sampled row costs what the sampler's exact path adds
beside a greedy one. `StepCost` holds those figures:

- `rows_ms`: a decode step's forward time (ms) by rows, interpolated between its points and
  past the last at its slope, rows rounded up to `row_group` past one (one row takes its own,
  cheaper, path). Only ratios between steps are read.
- the *row unit*, one computed token over a short context: a token attending over C earlier
  tokens costs 1 + C / `context_tokens_per_row` units, and a decode row's sampling adds
  `sampling_units`.

`PROFILED` is the profile of the default model in its Q4_1 blocks, batch-invariant, on a
2-core AMD EPYC Zen 3 (results/README.md, "The step-cost model", has the figures and the
commands that measured them). Plain Python over numbers (no torch), like the scheduler.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StepCost:
    rows_ms: tuple[tuple[int, float], ...]  # (decode rows, forward ms), rows ascending
    row_group: int  # rows the integer kernels compute together
    context_tokens_per_row: int  # attention context that costs as much as one more row
    sampled_row_units: float  # a plain temperature draw beside a greedy row
    typical_row_units: float  # typical_p's extra pass
    sigma_row_units: float  # top_n_sigma's extra pass
    logprob_alternative_units: float  # each top logprob reported

    def step_ms(self, rows: int) -> float:
        """A step's time with `rows` decode rows."""
        table = self.rows_ms
        if rows > 1:
            rows = -(-rows // self.row_group) * self.row_group
        for (low, low_ms), (high, high_ms) in itertools.pairwise(table):
            if rows <= high or high == table[-1][0]:
                return low_ms + (high_ms - low_ms) * (rows - low) / (high - low)
        return table[0][1]

    def units(self, num_tokens: int, context: int, extra: float = 0.0) -> float:
        """Row units of `num_tokens` tokens whose last attends over `context` tokens (a bound),
        each costing `extra` more (a sampled decode row's `sampling_units`)."""
        return num_tokens * (1 + extra + context / self.context_tokens_per_row)

    def sampling_units(self, params: SamplingParams) -> float:
        """What a decode row of a request with these parameters costs beyond its model row."""
        units = (params.logprobs or 0) * self.logprob_alternative_units
        if params.is_greedy:
            return units
        return (units + self.sampled_row_units + self.typical_row_units * (params.typical_p < 1)
                + self.sigma_row_units * (params.top_n_sigma > 0))


PROFILED = StepCost(rows_ms=((1, 12.4), (2, 18.8), (4, 19.5), (8, 35.3), (16, 59.3)), row_group=4,
                    context_tokens_per_row=600, sampled_row_units=0.3, typical_row_units=1.0,
                    sigma_row_units=0.7, logprob_alternative_units=0.04)
