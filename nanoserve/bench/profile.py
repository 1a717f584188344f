"""Where a decode step's time goes: per-phase cost and readbacks over batch sizes.

Owns: running `batch_size` requests through an `Engine` and attributing every decode step's
wall time and readbacks to its phases (schedule, prepare, forward, sample, collect), read from
the engine's own `stats.phase_s` and `stats.phase_readbacks`; the forward's split into its
matrix multiplies (every call of the model's `linear`, timed around the call), its attention
(every attention call; where every layer runs in one native call, the decoder's own timing of
RoPE + the K/V write + attention) and the rest of it (norms, activations, residual adds,
Python); and, on
request, a torch.profiler Chrome trace of a few steps, with the phases the engine names there;
for a mixture of experts, its routed-rows histogram and per-expert matmul time (`expert_profile`);
and each step beside its memory roofline (the weight bytes and the K/V bytes a step reads over
this machine's streaming read bandwidth, measured once per profile) and its linears beside the
cores' compute peak (`hardware.compute_peak`: int8 dot products for block formats, float32 FMAs
otherwise): `linear_peak_fraction` is the linears' operations a second over that peak.
Refuses: printing and file formats beyond the trace (the CLI and `charts` do those).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, record_function

from nanoserve import native
from nanoserve.bench.driver import StepRecord, run_closed_loop
from nanoserve.bench.hardware import compute_peak, read_bandwidth_gbs
from nanoserve.bench.offline import ModelCost, kv_blocks_for, sampling_params, synthetic_prompts
from nanoserve.config import EngineConfig
from nanoserve.engine.core import PHASES, Engine
from nanoserve.errors import InvalidRequestError
from nanoserve.model.kv_cache import bytes_per_token
from nanoserve.model.moe import ExpertTally


@dataclass(slots=True)
class StepCost:
    wall_s: float
    phase_s: dict[str, float]
    readbacks: dict[str, int]
    rows: int
    linear_s: float  # inside the forward's matrix multiplies
    attention_s: float  # inside the forward's attention
    allreduce_s: float = 0.0  # rank 0 inside the tensor-parallel all-reduces (waiting included)
    native_calls: int = 0  # calls into the native kernels (nanoserve.native.calls)


class LinearTimer:
    """Sums the wall time of every `model.linear` call (on CUDA, waiting for the device around
    each, so a kernel's time lands in it). Two clock reads a call: about 0.1 us, 121 calls a
    step on the default model. Where every layer runs in one native call (`model.decoder`),
    the decoder times its projections itself and `total_s` adds them."""

    def __init__(self, linear: Callable, sync_cuda: bool, decoder=None) -> None:
        self.linear = linear
        self.sync_cuda = sync_cuda
        self.seconds = 0.0
        self.decoder = decoder

    @property
    def total_s(self) -> float:
        return self.seconds + (self.decoder.linear_s if self.decoder is not None else 0.0)

    def __call__(self, x, weight):
        if self.sync_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.linear(x, weight)
        if self.sync_cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        return out


class AttentionTimer:
    """Sums the wall time of every attention call of the forward: the native kernel's (one
    layer's call), the torch attention's, and where every layer runs in one native call, the
    decoder's own timing of its RoPE + K/V write + attention stage (`total_s` adds it)."""

    def __init__(self, attend: Callable, decoder=None) -> None:
        self.attend = attend
        self.seconds = 0.0
        self.decoder = decoder

    @property
    def total_s(self) -> float:
        return self.seconds + (self.decoder.attention_s if self.decoder is not None else 0.0)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.attend(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return out

    def __getattr__(self, name: str):  # the torch attention's plan_step and properties
        return getattr(self.attend, name)


@contextmanager
def timed_attention(engine: Engine) -> Iterator[AttentionTimer]:
    """The engine's model with its attention timed (native or torch), for the duration of the block."""
    model = engine.model
    decoder = getattr(model, "decoder", None)
    torch_timer = AttentionTimer(model.torch_attention, decoder)
    model.torch_attention = torch_timer
    ops = getattr(model, "ops", None)
    native_timer = AttentionTimer(ops.paged_attention) if ops is not None else None
    if native_timer is not None:
        ops.paged_attention = native_timer
    if decoder is not None:
        decoder.attention_s = 0.0
    try:
        yield torch_timer if native_timer is None else _Both(torch_timer, native_timer)
    finally:
        model.torch_attention = torch_timer.attend
        if native_timer is not None:
            del ops.paged_attention  # the class's method again
        if decoder is not None:
            decoder.attention_s = None


@dataclass(slots=True)
class _Both:
    """Two timers read as one."""

    first: AttentionTimer
    second: AttentionTimer

    @property
    def total_s(self) -> float:
        return self.first.total_s + self.second.total_s


@contextmanager
def timed_linears(engine: Engine) -> Iterator[LinearTimer]:
    """The engine's model with its matrix multiplies timed, for the duration of the block."""
    model = engine.model
    decoder = getattr(model, "decoder", None)
    timer = LinearTimer(model.linear, sync_cuda=engine.device.type == "cuda", decoder=decoder)
    model.linear = timer
    if decoder is not None:
        decoder.linear_s = 0.0
    try:
        yield timer
    finally:
        model.linear = timer.linear
        if decoder is not None:
            decoder.linear_s = None


def _run_batch(engine: Engine, prompts: list[list[int]], mix: str, output_len: int) -> list[StepCost]:
    """Run the prompts to completion through the bench's one driver; the cost of each decode
    step, as the differences of the engine's own per-phase counters across it."""
    stats = engine.stats
    collectives = engine.tp.collectives if engine.tp is not None else None
    costs = []
    with timed_linears(engine) as linears, timed_attention(engine) as attention:
        def counters() -> tuple:
            reduce_s = collectives.reduce_s if collectives is not None else 0.0
            return (dict(stats.phase_s), dict(stats.phase_readbacks), linears.total_s, reduce_s,
                    native.calls(), attention.total_s)

        before = counters()

        def on_step(step: StepRecord) -> None:
            nonlocal before
            after = counters()
            if step.is_decode:
                phase_s = {p: after[0][p] - before[0][p] for p in PHASES}
                readbacks = {p: after[1][p] - before[1][p] for p in PHASES}
                costs.append(StepCost(step.seconds, phase_s, readbacks, step.rows, after[2] - before[2],
                                      after[5] - before[5], after[3] - before[3], after[4] - before[4]))
            before = after

        work = [(prompt, sampling_params(mix, row, output_len)) for row, prompt in enumerate(prompts)]
        run_closed_loop(engine, work, slots=len(work), on_step=on_step)
    return costs


def summarize(batch_size: int, costs: list[StepCost]) -> dict[str, float]:
    """Mean milliseconds and readbacks per decode step, per phase."""
    steps = len(costs)
    wall_s = sum(c.wall_s for c in costs) / steps
    row: dict[str, float] = {"batch_size": batch_size, "decode_steps": steps,
                             "mean_rows": sum(c.rows for c in costs) / steps, "step_ms": 1000 * wall_s}
    accounted = 0.0
    for phase in PHASES:
        seconds = sum(c.phase_s[phase] for c in costs) / steps
        accounted += seconds
        row[f"{phase}_ms"] = 1000 * seconds
        row[f"{phase}_share"] = seconds / wall_s
        row[f"{phase}_readbacks"] = sum(c.readbacks[phase] for c in costs) / steps
    row["other_ms"] = 1000 * max(0.0, wall_s - accounted)
    # The forward phase split: its matrix multiplies, and everything else it does.
    linear_s = sum(c.linear_s for c in costs) / steps
    row["forward_linear_ms"] = 1000 * linear_s
    # Attention: its own column and its share of the step (it grows with the context).
    row["forward_attention_ms"] = 1000 * sum(c.attention_s for c in costs) / steps
    row["attention_share"] = row["forward_attention_ms"] / row["step_ms"]
    row["forward_rest_ms"] = row["forward_ms"] - row["forward_linear_ms"] - row["forward_attention_ms"]
    row["forward_rest_ms_per_row"] = row["forward_rest_ms"] / row["mean_rows"]
    # Tensor parallelism: the all-reduces' share of the forward (0 with one rank).
    row["forward_allreduce_ms"] = 1000 * sum(c.allreduce_s for c in costs) / steps
    row["readbacks_per_step"] = sum(sum(c.readbacks.values()) for c in costs) / steps
    row["native_calls_per_step"] = sum(c.native_calls for c in costs) / steps
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
    prefix_caching: bool = True
    model: str | None = None
    device: str | None = None
    threads: int | None = None
    linear_kernel: str | None = None
    trace_path: Path | None = None
    trace_steps: int = 3  # decode steps traced per batch size
    # The forward's small ops: native (True) and/or torch (False), alternated per batch size
    # in one engine, so the two are measured side by side; None: as the engine runs them.
    native_ops: tuple[bool, ...] | None = None
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"


def build_engine(spec: ProfileSpec) -> Engine:
    biggest = max(spec.batch_sizes)
    return Engine(EngineConfig(
        model=spec.model, dtype=spec.dtype, device=spec.device, max_num_seqs=biggest,
        max_model_len=spec.input_len + spec.output_len + 1, batch_invariant=spec.batch_invariant,
        num_kv_blocks=kv_blocks_for(biggest, spec.input_len + spec.output_len + 1),
        max_num_batched_tokens=max(512, spec.input_len * biggest), threads=spec.threads,
        linear_kernel=spec.linear_kernel, enable_prefix_caching=spec.prefix_caching,
        tensor_parallel_size=spec.tensor_parallel_size, kv_cache_dtype=spec.kv_cache_dtype))


ProgressCallback = Callable[[int, int, int], None]


@contextmanager
def small_ops(engine: Engine, use_native: bool) -> Iterator[None]:
    """The engine's forward with its native small ops, or with the torch ones, for the block."""
    model = engine.model
    ops = model.ops
    if use_native and ops is None:
        raise InvalidRequestError(f"native small ops do not run here ({native.status()}; they need "
                                  "float32 on the CPU)", param="native_ops")
    model.ops = ops if use_native else None
    try:
        yield
    finally:
        model.ops = ops


def profile_engine(engine: Engine, spec: ProfileSpec,
                   progress: ProgressCallback | None = None) -> pd.DataFrame:
    """One row per batch size (and small-ops choice): the mean decode step, split by phase."""
    engine.sync_phases = engine.device.type == "cuda"
    rows = []
    for index, batch_size in enumerate(spec.batch_sizes):
        if progress:
            progress(batch_size, index, len(spec.batch_sizes))
        for use_native in spec.native_ops or (engine.model.ops is not None,):
            with small_ops(engine, use_native):
                warm = synthetic_prompts(batch_size, spec.input_len, engine.vocab_size, seed=1)
                _run_batch(engine, warm, spec.params, min(8, spec.output_len))
                prompts = synthetic_prompts(batch_size, spec.input_len, engine.vocab_size)
                costs = _run_batch(engine, prompts, spec.params, spec.output_len)
            rows.append({**summarize(batch_size, costs), "native_ops": use_native})
    if spec.trace_path is not None:
        write_trace(engine, spec)
    if progress:
        progress(spec.batch_sizes[-1], len(spec.batch_sizes), len(spec.batch_sizes))
    frame = pd.DataFrame(rows)
    weight_bytes = ModelCost.of_engine(engine).weight_bytes
    # Each decode row reads its context's K/V: on average the prompt and half the output.
    kv_token_bytes = bytes_per_token(engine.model_config, engine.kv_cache.cache_dtype)
    kv_bytes = frame["mean_rows"] * (spec.input_len + spec.output_len / 2) * kv_token_bytes
    read_gbs = read_bandwidth_gbs(engine.device)
    roofline_ms = 1e3 * (weight_bytes + kv_bytes) / (read_gbs * 1e9)
    frame = frame.assign(weight_bytes_per_step=weight_bytes, kv_bytes_per_step=kv_bytes,
                         measured_read_gbs=read_gbs, roofline_step_ms=roofline_ms,
                         roofline_fraction=roofline_ms / frame["step_ms"])
    frame = with_compute_peak(frame, engine)
    return frame.assign(params=spec.params, dtype=spec.dtype, weight_format=engine.weight_format,
                        batch_invariant=spec.batch_invariant, prefix_caching=spec.prefix_caching,
                        input_len=spec.input_len, output_len=spec.output_len)


def with_compute_peak(frame: pd.DataFrame, engine: Engine) -> pd.DataFrame:
    """The frame with the linears' operations a step and their fraction of the cores' peak (int8
    for a block-format model, float32 otherwise); unchanged where no peak probe runs (the
    native library off, or a GPU)."""
    peak = compute_peak(engine.threads) if engine.device.type == "cpu" else None
    if peak is None:
        return frame
    quantized = engine.weight_format.split("+")[0] not in ("float32", "bfloat16", "float16")
    peak_gops = peak.int8_gops if quantized else peak.f32_gflops
    ops = 2.0 * engine.model_config.matmul_params * frame["mean_rows"]
    achieved_gops = ops / (frame["forward_linear_ms"] / 1e3) / 1e9
    return frame.assign(**peak.columns(), linear_ops_per_step=ops, linear_gops=achieved_gops,
                        linear_peak_fraction=achieved_gops / peak_gops)


def write_trace(engine: Engine, spec: ProfileSpec) -> Path:
    """A Chrome trace (chrome://tracing, ui.perfetto.dev) of a prefill and a few decode steps per size."""
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = min(spec.trace_steps, spec.output_len)
    engine.label_phases = True
    try:
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            for batch_size in spec.batch_sizes:
                with record_function(f"nanoserve.batch_size={batch_size}"):
                    prompts = synthetic_prompts(batch_size, spec.input_len, engine.vocab_size, seed=2)
                    _run_batch(engine, prompts, spec.params, steps + 1)
    finally:
        engine.label_phases = False
    spec.trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(spec.trace_path))
    return spec.trace_path


def expert_profile(engine: Engine, spec: ProfileSpec) -> pd.DataFrame | None:
    """A mixture of experts' decode steps per batch size: the routed-rows histogram (rows routed
    to each expert per step, summed over the sparse layers and per sparse layer) and each
    expert's matmul time per step (the one native call times each expert with a barrier around
    it; the loop, around its two matmuls). None for a dense model."""
    model = engine.model
    if model.moe is None:
        return None
    count, sparse_layers = model.config.experts.count, sum(model.config.experts.sparse_layers)
    rows = []
    for batch_size in spec.batch_sizes:
        warm = synthetic_prompts(batch_size, spec.input_len, engine.vocab_size, seed=1)
        _run_batch(engine, warm, spec.params, min(8, spec.output_len))
        prompts = synthetic_prompts(batch_size, spec.input_len, engine.vocab_size)
        decode, steps = _decode_tally(engine, prompts, spec.params, spec.output_len)
        routed = decode.rows.sum().item()
        for expert in range(count):
            expert_rows = decode.rows[expert].item()
            rows.append({"batch_size": batch_size, "expert": expert, "decode_steps": steps,
                         "sparse_layers": sparse_layers, "rows_per_step": expert_rows / steps,
                         "rows_per_layer_step": expert_rows / steps / sparse_layers,
                         "row_share": expert_rows / routed if routed else 0.0,
                         "expert_ms_per_step": 1000 * decode.seconds[expert].item() / steps})
    return pd.DataFrame(rows).assign(top_k=model.config.experts.top_k, params=spec.params,
                                     weight_format=engine.weight_format,
                                     native_experts=any(e is not None for e in model.native_experts))


def _decode_tally(engine: Engine, prompts: list[list[int]], mix: str,
                  output_len: int) -> tuple[ExpertTally, int]:
    """The prompts run to completion with the experts tallied: the decode steps' tally (prefill
    steps route their rows too, and are left out) and how many decode steps there were."""
    moe = engine.model.moe
    moe.tally = tally = ExpertTally.zeros(moe.spec.count)
    decode, steps = ExpertTally.zeros(moe.spec.count), 0
    before = (tally.rows.clone(), tally.seconds.clone())

    def on_step(step: StepRecord) -> None:
        nonlocal before, steps
        if step.is_decode:
            decode.rows += tally.rows - before[0]
            decode.seconds += tally.seconds - before[1]
            steps += 1
        before = (tally.rows.clone(), tally.seconds.clone())

    work = [(prompt, sampling_params(mix, row, output_len)) for row, prompt in enumerate(prompts)]
    try:
        run_closed_loop(engine, work, slots=len(work), on_step=on_step)
    finally:
        moe.tally = None
    return decode, steps
