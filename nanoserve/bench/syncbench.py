"""The syncbench: what one sampling step costs, the batched sampler against a per-row loop.

Owns: the sampling mixes of the sweep, a [rows, vocab] logits batch made from one row, the
per-row loop a naive engine would run (kept here as the baseline only: each row's filters in
plain torch with a full sort for top_p, `torch.multinomial` with its own `torch.Generator`,
one `.item()` per row), the timing of both in the same run, readbacks counted per step, the
verdict on whether a run was too noisy to read (`noise_warning`: the load average over the
cores, or timed steps spreading too far around their median), and the CSV written to results/
with its chart beside it. Refuses: asserting timings, printing (the CLI does) and drawing
(`charts.syncbench_chart` does).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor

from nanoserve.bench import charts
from nanoserve.bench.driver import percentile
from nanoserve.bench.hardware import describe_machine
from nanoserve.engine.sampler import BatchedSampler, SamplingBatch, SamplingRow
from nanoserve.sampling_params import SamplingParams

ROWS = (1, 2, 4, 8, 16, 32)
# Settings shared with the offline bench's mixes; "mixed" cycles through MIXED_CYCLE per row.
SETTINGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k": SamplingParams(temperature=0.8, top_k=50),
    "min_p": SamplingParams(temperature=1.0, min_p=0.05),
    "typical_p": SamplingParams(temperature=0.8, typical_p=0.9),
    "top_n_sigma": SamplingParams(temperature=1.0, top_n_sigma=1.0),
    "p_less": SamplingParams(temperature=1.0, p_less=True),
    "penalties": SamplingParams(temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.3,
                                presence_penalty=0.2),
}
MIXED_CYCLE = ("greedy", "top_p", "top_k", "min_p", "penalties")
MIXES = ("greedy", "top_p", "top_k", "min_p", "typical_p", "top_n_sigma", "p_less", "mixed")
PERTURBATION = 0.05  # per-row noise on the logits, in logits: rows differ, the shape stays
HISTORY = 24  # prompt and generated tokens per row, for the penalties
# A row's timed steps whose interquartile range exceeds this fraction of their median did not
# measure one cost: something else took the cores in between, and its speedup is not a figure.
NOISY_SPREAD = 0.25


def params_for(mix: str, row: int) -> SamplingParams:
    """The sampling parameters of `row` in `mix`."""
    return SETTINGS[MIXED_CYCLE[row % len(MIXED_CYCLE)] if mix == "mixed" else mix]


def synthetic_logits_row(vocab: int = 49152, *, seed: int = 0) -> Tensor:
    """An LM-shaped row (synthetic): a Zipf-like power law over shuffled ids, plus noise."""
    generator = torch.Generator().manual_seed(seed)
    rank = torch.randperm(vocab, generator=generator).float() + 1
    return -1.2 * torch.log(rank) + 0.3 * torch.randn(vocab, generator=generator) + 8.0


def batch_logits(logits_row: Tensor, rows: int, *, seed: int = 0) -> Tensor:
    """`rows` copies of one row, each nudged by small noise so that rows differ."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(rows, logits_row.shape[-1], generator=generator) * PERTURBATION
    return (logits_row.float().cpu() + noise).to(logits_row.device)


def sampling_rows(mix: str, rows: int, vocab: int) -> list[SamplingRow]:
    history = [(row * 7919 + i * 104729) % vocab for row in range(rows) for i in range(HISTORY)]
    return [SamplingRow(params_for(mix, row), seed=1234 + row, position=HISTORY // 2,
                        prompt_ids=history[row * HISTORY:row * HISTORY + HISTORY // 2],
                        output_ids=history[row * HISTORY + HISTORY // 2:(row + 1) * HISTORY])
            for row in range(rows)]


class ReadbackCounter:
    """Counts Tensor.tolist and Tensor.item calls while active: the host readbacks of a step."""

    def __init__(self) -> None:
        self.count = 0

    @contextmanager
    def counting(self) -> Iterator[None]:
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}

        def wrap(original: Callable) -> Callable:
            def counted(tensor: Tensor, *args: object) -> object:
                self.count += 1
                return original(tensor, *args)
            return counted

        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)


def _per_row_filters(logits: Tensor, row: SamplingRow) -> Tensor:
    """One row's filters the way a naive engine writes them: a full sort for top_p."""
    p = row.params
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted({*row.prompt_ids, *row.output_ids}), device=logits.device)
        cells = logits[seen]
        logits[seen] = torch.where(cells > 0, cells / p.repetition_penalty, cells * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(torch.tensor(list(row.output_ids), device=logits.device),
                                minlength=logits.shape[-1]).float()
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    logits = logits / p.temperature
    if p.top_n_sigma > 0:
        finite = logits[logits.isfinite()]
        cut = finite.max() - p.top_n_sigma * finite.std(unbiased=False)
        logits = logits.masked_fill(logits < cut, -torch.inf)
    if p.top_k > 0:
        logits = logits.masked_fill(logits < torch.topk(logits, p.top_k).values[-1], -torch.inf)
    if p.typical_p < 1:
        logits = _per_row_typical(logits, p.typical_p)
    if p.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p
        logits = logits.scatter(0, order, ordered.masked_fill(drop, -torch.inf))
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), -torch.inf)
    if p.p_less:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < probs.square().sum(), -torch.inf)
    return logits


def _per_row_typical(logits: Tensor, typical_p: float) -> Tensor:
    """transformers' TypicalLogitsWarper on one row: a full sort by distance from the entropy."""
    log_q = logits.log_softmax(-1)
    entropy = -(log_q.exp() * log_q).nansum()
    shifted, order = (-log_q - entropy).abs().sort()
    last = int((log_q.exp()[order].cumsum(-1) < typical_p).sum().clamp(max=logits.shape[-1] - 1))
    return logits.masked_fill((-log_q - entropy).abs() > shifted[last], -torch.inf)


def per_row_step(logits: Tensor, rows: Sequence[SamplingRow],
                 generators: Sequence[torch.Generator]) -> list[int]:
    """The baseline: a Python loop over rows, one draw and one readback each."""
    tokens = []
    for i, row in enumerate(rows):
        if row.params.is_greedy:
            tokens.append(logits[i].argmax().item())
            continue
        probs = _per_row_filters(logits[i].float().clone(), row).softmax(-1)
        tokens.append(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens


def batched_step(logits: Tensor, rows: Sequence[SamplingRow], sampler: BatchedSampler) -> list[int]:
    """The engine: build the step's batch, one vectorized pass, one readback."""
    batch = SamplingBatch.build(rows, vocab_size=logits.shape[-1], eos_token_ids=(),
                                device=logits.device)
    return sampler(logits, batch).token_ids.tolist()


@dataclass(slots=True)
class StepTimes:
    """Wall times and readbacks of one way of sampling, over the timed steps."""

    times_s: list[float] = field(default_factory=list)
    counter: ReadbackCounter = field(default_factory=ReadbackCounter)

    def time(self, step: Callable[[], object], device: torch.device) -> None:
        with self.counter.counting():
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times_s.append(time.perf_counter() - start)

    @property
    def median_ms(self) -> float:
        return percentile(self.times_s, 50) * 1e3

    @property
    def readbacks_per_step(self) -> float:
        return self.counter.count / len(self.times_s)

    @property
    def spread(self) -> float:
        """The interquartile range of the timed steps over their median (0: every step alike)."""
        return (percentile(self.times_s, 75) - percentile(self.times_s, 25)) / percentile(self.times_s, 50)


def _measure(logits: Tensor, mix: str, *, repeat: int, warmup: int) -> dict[str, object]:
    rows = sampling_rows(mix, logits.shape[0], logits.shape[1])
    generators = [torch.Generator(logits.device).manual_seed(row.seed) for row in rows]
    sampler = BatchedSampler()
    steps = {"engine": lambda: batched_step(logits, rows, sampler),
             "baseline": lambda: per_row_step(logits, rows, generators)}
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {who: StepTimes() for who in steps}
    for _ in range(repeat):  # interleaved, so both see the same load on a shared machine
        for who, step in steps.items():
            times[who].time(step, logits.device)
    engine, baseline = times["engine"], times["baseline"]
    return {"rows": logits.shape[0], "mix": mix, "vocab": logits.shape[1],
            "engine_ms": engine.median_ms, "baseline_ms": baseline.median_ms,
            "speedup": baseline.median_ms / engine.median_ms,
            "engine_spread": engine.spread, "baseline_spread": baseline.spread,
            "engine_readbacks_per_step": engine.readbacks_per_step,
            "baseline_readbacks_per_step": baseline.readbacks_per_step}


def run_syncbench(logits_row: Tensor, rows_list: Sequence[int] = ROWS,
                  mixes: Sequence[str] = MIXES, repeat: int = 20, warmup: int = 3, *,
                  logits_source: str = "synthetic") -> pd.DataFrame:
    """Time a sampling step for every rows x mix: the batched sampler and the per-row loop.

    `logits_row` is one [vocab] row (from the model, or `synthetic_logits_row`); each step
    samples from it stacked `rows` times with small per-row noise, on its device.
    """
    records, load_before = [], os.getloadavg()[0]
    for rows in rows_list:
        logits = batch_logits(logits_row, rows)
        records += [_measure(logits, mix, repeat=repeat, warmup=warmup) for mix in mixes]
    frame = pd.DataFrame.from_records(records)
    greedy = frame[frame.mix == "greedy"].set_index("rows")
    for who in ("engine", "baseline"):
        frame[f"{who}_vs_greedy"] = frame[f"{who}_ms"] / frame.rows.map(greedy[f"{who}_ms"])
    machine = describe_machine(logits_row.device).columns()
    return frame.assign(logits_source=logits_source, dtype=str(logits_row.dtype).removeprefix("torch."),
                        repeat=repeat, warmup=warmup, load_avg_1m=max(load_before, os.getloadavg()[0]),
                        **machine)


def noise_warning(frame: pd.DataFrame) -> str | None:
    """Why this run's ratios should not be read as figures, or None: a load average above the
    cores (others' work ran between the timed steps), or rows whose timed steps spread more
    than NOISY_SPREAD around their median."""
    reasons = []
    load, cores = frame.load_avg_1m.max(), frame.cores.iloc[0]
    if load > cores:
        reasons.append(f"the load average was {load:.1f} on {cores} cores")
    noisy = frame[(frame.engine_spread > NOISY_SPREAD) | (frame.baseline_spread > NOISY_SPREAD)]
    if len(noisy):
        reasons.append(f"{len(noisy)} of {len(frame)} rows had timed steps spreading more than "
                       f"{NOISY_SPREAD:.0%} around their median (engine_spread, baseline_spread)")
    if not reasons:
        return None
    return ("warning: noisy measurement: " + "; ".join(reasons)
            + ". The speedups are not figures; rerun on an idle machine (or with more --repeat).")


def write_syncbench_outputs(frame: pd.DataFrame, out_dir: Path,
                            name: str = "syncbench") -> tuple[Path, Path]:
    """Write results/NAME.csv and results/NAME.png; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out_dir / f"{name}.csv", out_dir / f"{name}.png"
    frame.to_csv(csv_path, index=False)
    charts.syncbench_chart(frame, png_path)
    return csv_path, png_path
