"""Where a decode step's time goes: per-phase cost and readbacks over batch sizes.

Owns: running `batch_size` requests through an `Engine` and attributing every decode step's
wall time to its phases (schedule, prepare, forward, sample, collect) from the engine's own
`stats.phase_s`, with the sampler timed apart from the forward it sits inside, and the
readbacks each phase made; and, on request, a torch.profiler Chrome trace of a few steps.
The phase wrappers are installed for the run and removed after it; the engine is not changed.
Refuses: printing and file formats beyond the trace (the CLI and `charts` do those).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, record_function

from nanoserve.bench.offline import kv_blocks_for, sampling_params, synthetic_prompts

PHASES = ("schedule", "prepare", "forward", "sample", "collect")
# The engine method each phase's readbacks and trace label are taken from (owner path, attribute).
PHASE_CALLS = {
    "schedule": ("scheduler", "schedule"),
    "prepare": ("runner", "prepare"),
    "forward": ("runner", "execute"),
    "sample": ("runner", "sampler"),
    "collect": ("", "_collect"),
}


@dataclass(slots=True)
class PhaseCounters:
    """Running totals the wrappers add to: readbacks and (for the sampler) seconds per phase."""

    readbacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    sample_s: float = 0.0


class PhaseProbe:
    """Wraps the engine's phase calls for the duration of a `with` block."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.counters = PhaseCounters()
        self.cuda = engine.device.type == "cuda"

    @contextlib.contextmanager
    def installed(self) -> Iterator[PhaseCounters]:
        restore = []
        for phase, (owner_name, attribute) in PHASE_CALLS.items():
            owner = getattr(self.engine, owner_name) if owner_name else self.engine
            # A method lives on the class: deleting the instance's wrapper restores it.
            own = vars(owner).get(attribute)
            restore.append((owner, attribute, own))
            setattr(owner, attribute, self._wrap(phase, getattr(owner, attribute)))
        try:
            yield self.counters
        finally:
            for owner, attribute, own in reversed(restore):
                if own is None:
                    delattr(owner, attribute)
                else:
                    setattr(owner, attribute, own)

    def _wrap(self, phase: str, call: Callable[..., Any]) -> Callable[..., Any]:
        counters, engine, cuda = self.counters, self.engine, self.cuda

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            readbacks = engine.readbacks.count
            if phase == "sample" and cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with record_function(f"nanoserve.{phase}"):
                result = call(*args, **kwargs)
            if phase == "sample":
                if cuda:
                    torch.cuda.synchronize()
                counters.sample_s += time.perf_counter() - start
            counters.readbacks[phase] += engine.readbacks.count - readbacks
            return result

        return wrapped


@dataclass(slots=True)
class StepCost:
    wall_s: float
    phase_s: dict[str, float]
    readbacks: dict[str, int]
    rows: int


def _run_batch(engine: Any, counters: PhaseCounters, prompts: list[list[int]], mix: str,
               output_len: int) -> list[StepCost]:
    """Run the prompts to completion; the cost of each decode step."""
    for row, prompt in enumerate(prompts):
        engine.add_request(prompt, sampling_params(mix, row, output_len))
    costs = []
    while engine.has_unfinished():
        before_phases = dict(engine.stats.phase_s)
        before_readbacks = dict(counters.readbacks)
        before_sample, decode_steps = counters.sample_s, engine.stats.decode_steps
        start = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - start
        if engine.stats.decode_steps == decode_steps:
            continue
        phase_s = {p: engine.stats.phase_s[p] - before_phases[p] for p in engine.stats.phase_s}
        phase_s["sample"] = counters.sample_s - before_sample
        phase_s["forward"] = phase_s.get("forward", 0.0) - phase_s["sample"]
        readbacks = {p: counters.readbacks[p] - before_readbacks[p] for p in PHASES}
        # The sampler runs inside execute: its readbacks are counted in both; keep them in sample.
        readbacks["forward"] -= readbacks["sample"]
        costs.append(StepCost(wall, phase_s, readbacks, len(outputs)))
    return costs


def summarize(batch_size: int, costs: list[StepCost]) -> dict[str, float]:
    """Mean milliseconds and readbacks per decode step, per phase."""
    steps = len(costs)
    wall_s = sum(c.wall_s for c in costs) / steps
    row: dict[str, float] = {"batch_size": batch_size, "decode_steps": steps,
                             "mean_rows": sum(c.rows for c in costs) / steps, "step_ms": 1000 * wall_s}
    accounted = 0.0
    for phase in PHASES:
        seconds = sum(c.phase_s.get(phase, 0.0) for c in costs) / steps
        accounted += seconds
        row[f"{phase}_ms"] = 1000 * seconds
        row[f"{phase}_share"] = seconds / wall_s
        row[f"{phase}_readbacks"] = sum(c.readbacks[phase] for c in costs) / steps
    row["other_ms"] = 1000 * max(0.0, wall_s - accounted)
    row["readbacks_per_step"] = sum(sum(c.readbacks.values()) for c in costs) / steps
    row["decode_tokens_per_s"] = row["mean_rows"] / wall_s
    return row


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    input_len: int = 32
    output_len: int = 64
    params: str = "greedy"
    dtype: str = "float32"
    batch_invariant: bool = True
    model: str | None = None
    device: str | None = None
    threads: int | None = None
    linear_kernel: str | None = None
    trace_path: Path | None = None
    trace_steps: int = 3  # decode steps traced per batch size


def build_engine(spec: ProfileSpec) -> Any:
    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine

    biggest = max(spec.batch_sizes)
    return Engine(EngineConfig(
        model=spec.model, dtype=spec.dtype, device=spec.device, max_num_seqs=biggest,
        max_model_len=spec.input_len + spec.output_len + 1, batch_invariant=spec.batch_invariant,
        num_kv_blocks=kv_blocks_for(biggest, spec.input_len + spec.output_len + 1),
        max_num_batched_tokens=max(512, spec.input_len * biggest), threads=spec.threads,
        linear_kernel=spec.linear_kernel))


ProgressCallback = Callable[[int, int, int], None]


def profile_engine(engine: Any, spec: ProfileSpec, progress: ProgressCallback | None = None) -> pd.DataFrame:
    """One row per batch size: the mean decode step, split by phase."""
    engine.sync_phases = engine.device.type == "cuda"
    probe = PhaseProbe(engine)
    rows = []
    with probe.installed() as counters:
        for index, batch_size in enumerate(spec.batch_sizes):
            if progress:
                progress(batch_size, index, len(spec.batch_sizes))
            warm = synthetic_prompts(batch_size, spec.input_len, engine.vocab_size, seed=1)
            _run_batch(engine, counters, warm, spec.params, min(8, spec.output_len))
            prompts = synthetic_prompts(batch_size, spec.input_len, engine.vocab_size)
            costs = _run_batch(engine, counters, prompts, spec.params, spec.output_len)
            rows.append(summarize(batch_size, costs))
        if spec.trace_path is not None:
            write_trace(engine, counters, spec)
    if progress:
        progress(spec.batch_sizes[-1], len(spec.batch_sizes), len(spec.batch_sizes))
    frame = pd.DataFrame(rows)
    return frame.assign(params=spec.params, dtype=spec.dtype, batch_invariant=spec.batch_invariant,
                        input_len=spec.input_len, output_len=spec.output_len)


def write_trace(engine: Any, counters: PhaseCounters, spec: ProfileSpec) -> Path:
    """A Chrome trace (chrome://tracing, ui.perfetto.dev) of a prefill and a few decode steps per size."""
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = min(spec.trace_steps, spec.output_len)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for batch_size in spec.batch_sizes:
            with record_function(f"nanoserve.batch_size={batch_size}"):
                prompts = synthetic_prompts(batch_size, spec.input_len, engine.vocab_size, seed=2)
                _run_batch(engine, counters, prompts, spec.params, steps + 1)
    spec.trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(spec.trace_path))
    return spec.trace_path
