"""The offline bench: synthetic workloads through the closed-loop driver, per-config metrics.

Owns: prompts of exactly `input_len` token ids, the sampling mixes (greedy, top_p, top_k,
typical_p, top_n_sigma, p_less, mixed per row, and structured: top_p under a JSON schema),
the sweep (each config run through `driver.run_closed_loop` with `slots` requests in
flight), the figures made from its timings
(tokens/s, requests/s, time to first token, time per output token, decode step time,
readbacks per step, peak memory), the roofline columns (achieved GB/s and GFLOP/s against the
probes of `hardware`), and Hugging Face transformers' `generate` on the same workload, in the
same run.
Refuses: printing, progress bars and file formats (the CLI and `charts` do those), and timing
the engine itself (`driver` does).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from nanoserve.bench.driver import (
    RequestTimes,
    RunRecord,
    StepRecord,
    latency_ms,
    percentile,
    run_closed_loop,
)
from nanoserve.bench.hardware import HardwareLimits, Machine, PeakMemory, describe_machine, probe_limits
from nanoserve.config import DTYPES, EngineConfig, ModelConfig
from nanoserve.engine.core import Engine
from nanoserve.quant import is_quantized
from nanoserve.sampling_params import SamplingParams, StructuredOutputs

# Sampling settings of each mix, as keyword arguments (SamplingParams and HF generate share them).
SAMPLING_SETTINGS: dict[str, dict[str, float | int]] = {
    "greedy": {"temperature": 0.0},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "top_k": {"temperature": 0.8, "top_k": 50},
    "typical_p": {"temperature": 0.8, "typical_p": 0.9},
    "top_n_sigma": {"temperature": 1.0, "top_n_sigma": 1.0},
    "p_less": {"temperature": 1.0, "p_less": True},
}
# mixed: rows cycle greedy, top_p, top_k. structured: top_p's sampling, every row held to
# STRUCTURED_SCHEMA by its own grammar matcher.
PARAM_MIXES = (*SAMPLING_SETTINGS, "mixed", "structured")
# A list of records whose shortest answer is longer than a bench output, so constrained rows
# end by length like every other mix's rather than leaving the batch early.
STRUCTURED_SCHEMA = {"type": "array", "minItems": 16, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "score": {"type": "integer"}, "tags": {"type": "array", "items": {
                                         "enum": ["new", "old", "hot"]}}},
    "required": ["name", "score", "tags"], "additionalProperties": False}}
# The mixes transformers' generate can run: it has no top_n_sigma and no per-row settings.
BASELINE_MIXES = ("greedy", "top_p", "top_k", "typical_p")
BASELINES = ("transformers",)
SEED_BASE = 1234
REPEAT_PROMPT_MAX_LEN = 448  # the repeat workload's chat prompts stay below this many tokens


def _torch_dtype(name: str, default: torch.dtype) -> torch.dtype:
    """torch's dtype of a --dtype float precision; `default` for auto and quantized."""
    return getattr(torch, name) if name in DTYPES else default

def row_settings(mix: str, row: int) -> dict[str, float | int]:
    """The sampling settings of request `row` in mix `mix`."""
    if mix == "mixed":
        return SAMPLING_SETTINGS[("greedy", "top_p", "top_k")[row % 3]]
    return SAMPLING_SETTINGS["top_p" if mix == "structured" else mix]


def sampling_params(mix: str, row: int, output_len: int, *, ignore_eos: bool = True) -> SamplingParams:
    settings = row_settings(mix, row)
    seed = SEED_BASE + row if settings["temperature"] > 0 else None
    structured = StructuredOutputs(json=STRUCTURED_SCHEMA) if mix == "structured" else None
    return SamplingParams(max_tokens=output_len, ignore_eos=ignore_eos, seed=seed,
                          structured_outputs=structured, **settings)


def synthetic_prompts(count: int, input_len: int, vocab_size: int, *, seed: int = 0,
                      shared_prefix_len: int = 0) -> list[list[int]]:
    """`count` prompts of exactly `input_len` ids, drawn clear of the low (special) ids; the
    first `shared_prefix_len` ids are the same in every prompt, whatever `seed` (a system prompt)."""
    low = min(100, vocab_size // 4)
    prefix = torch.randint(low, vocab_size, (shared_prefix_len,),
                           generator=torch.Generator().manual_seed(SEED_BASE)).tolist()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab_size, (count, input_len - shared_prefix_len), generator=generator)
    return [prefix + row for row in ids.tolist()]


PROMPT_KINDS = ("synthetic", "repeat")
# The "repeat" workload: an edit of code given in the prompt, the case prompt lookup (speculative
# decoding by n-grams) is for. The prompt asks to fix one typo (`retrun`) in three functions or
# classes, and the reply is begun with its code fence, as an editor's "apply this edit" prompt
# begins it: the answer is then the code again, one token fixed. (Asked only to "repeat this
# passage", the default 135M model paraphrases the code instead: 37% of drafts accepted.) Each
# prompt's code is drawn from these templates with its own names and numbers, so no two prompts
# share more than the instruction.
_CODE_TEMPLATES = (
    "def {name}(values):\n    total = 0\n    for value in values:\n        if value > {a}:\n"
    "            total += value * {b}\n    return total\n",
    "class {cls}:\n    def __init__(self, size={a}):\n        self.size = size\n"
    "        self.items = []\n\n    def add(self, item):\n"
    "        if len(self.items) < self.size:\n            self.items.append(item)\n",
    "def {name}_table(n):\n    rows = []\n    for i in range(n):\n"
    "        rows.append([i * j for j in range({b})])\n    retrun rows\n",
)
_NAMES = ("parse", "score", "merge", "render", "count", "scale", "filter", "collect", "update", "report")
REPEAT_INSTRUCTION = "Fix the typo in this code (`retrun` should be `return`). Reply with the full code only."
REPEAT_REPLY_START = "```python\n"


def repeat_passage(seed: int) -> str:
    """Python code of three functions or classes, one `retrun` typo in the last, its names and
    numbers drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)

    def pick(options: Sequence[str]) -> str:
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    parts = []
    for template in _CODE_TEMPLATES:
        name = pick(_NAMES)
        a, b = (int(v) for v in torch.randint(2, 99, (2,), generator=generator))
        parts.append(template.format(name=name, cls=name.capitalize() + "Store", a=a, b=b))
    return "\n".join(parts)


def repeat_prompts(tokenizer, count: int, *, seed: int = 0) -> list[list[int]]:
    """`count` chat prompts asking for a one-token fix of code given in the prompt, the reply
    begun with its code fence."""
    reply_start = tokenizer.encode(REPEAT_REPLY_START, add_bos=False)
    return [tokenizer.encode_chat([{"role": "user", "content": (
        f"{REPEAT_INSTRUCTION}\n\n```python\n{repeat_passage(seed * 1000 + i)}```")}]) + reply_start
        for i in range(count)]


def kv_blocks_for(num_seqs: int, max_len: int, block_size: int = 16) -> int:
    """A KV pool that holds every slot at full length: the bench measures batching, not preemption.

    Sized per sequence, since each rounds up to whole blocks (the engine's default sizes the pool
    from the sum of the lengths, which can fit fewer sequences than `max_num_seqs`).
    """
    return num_seqs * -(-max_len // block_size)


@dataclass(frozen=True, slots=True)
class Workload:
    input_len: int = 32
    output_len: int = 64
    num_requests: int | None = None  # None: as many as slots, all in flight at once
    warmup: int = 1  # untimed short runs before the timed ones, per config
    repeat: int = 1  # timed runs per config; the run with the median tokens/s is kept
    shared_prefix_len: int = 0  # leading ids every prompt shares (within input_len)
    # synthetic: random ids of input_len; repeat: the answer copies code in the prompt, one typo
    # fixed (about 150 tokens; EOS ends a request, output_len at most)
    prompts: str = "synthetic"

    def __post_init__(self) -> None:
        if self.prompts not in PROMPT_KINDS:
            raise ValueError(f"prompts must be one of {', '.join(PROMPT_KINDS)}, got {self.prompts!r}")
        if not 0 <= self.shared_prefix_len <= self.input_len:
            raise ValueError(f"shared_prefix_len must be in [0, input_len={self.input_len}], "
                             f"got {self.shared_prefix_len}")

    def requests_for(self, slots: int) -> int:
        return self.num_requests or slots


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One row of a sweep: which engine, how many slots, which sampling mix, which precision."""

    engine: str  # "nanoserve" or a baseline's name
    slots: int
    params: str
    dtype: str
    batch_invariant: bool = False
    prefix_caching: bool = True
    speculative_tokens: int = 0
    async_scheduling: bool = False

    @property
    def label(self) -> str:
        kernels = ", batch-invariant" if self.batch_invariant else ""
        cache = "" if self.prefix_caching else ", no prefix cache"
        spec = f", {self.speculative_tokens} drafts" if self.speculative_tokens else ""
        spec += ", deferred output" if self.async_scheduling else ""
        return f"{self.engine} {self.dtype}{kernels}{cache}{spec}: {self.slots} slots, {self.params}"


def _latency_columns(prefix: str, values_s: Sequence[float]) -> dict[str, float]:
    """`{prefix}_mean_ms`, `_median_ms` and `_p99_ms`, as `driver.latency_ms` defines them."""
    return {f"{prefix}_{stat}_ms": value for stat, value in latency_ms(values_s).items() if stat != "std"}


def request_metrics(run: RunRecord) -> dict[str, float]:
    """Throughput and latency figures every engine's run can give."""
    ttft = [r.first_token_s - r.added_s for r in run.requests if r.first_token_s is not None]
    tpot = [(r.finished_s - r.first_token_s) / (r.num_tokens - 1) for r in run.requests
            if r.finished_s is not None and r.first_token_s is not None and r.num_tokens > 1]
    return {
        "num_requests": len(run.requests),
        "output_tokens": run.output_tokens,
        "elapsed_s": run.elapsed_s,
        "output_tokens_per_s": run.tokens_per_s,
        "requests_per_s": len(run.requests) / run.elapsed_s,
        **_latency_columns("ttft", ttft),
        **_latency_columns("tpot", tpot),
        "peak_memory_mib": run.peak_memory_mib,
    }


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What a decode step must read and compute, from the model's shape and precision."""

    weight_bytes: float
    flops_per_token_at: Callable[[int], float]

    @classmethod
    def of(cls, model_config: ModelConfig, dtype: torch.dtype) -> ModelCost:
        element = torch.tensor([], dtype=dtype).element_size()
        return cls(model_config.matmul_params * element, model_config.flops_per_token)

    @classmethod
    def of_engine(cls, engine: Engine) -> ModelCost:
        """Quantized weights: the bytes of the blocks a step reads (its own format's roofline)."""
        weights = engine.model.weights
        if not is_quantized(weights.lm_head):
            return cls.of(engine.model_config, engine.dtype)
        lookup_only = 0 if weights.lm_head is weights.embed else weights.embed.nbytes
        return cls(engine.weights_nbytes - lookup_only, engine.model_config.flops_per_token)

    def step_flops(self, step: StepRecord) -> float:
        """Forward FLOPs of a step's rows, each at its own context length."""
        return sum(self.flops_per_token_at(length) for length in step.context_lens)


def step_metrics(run: RunRecord, cost: ModelCost, limits: HardwareLimits) -> dict[str, float]:
    """Decode-step figures read against the roofline: achieved GB/s and GFLOP/s beside the limits."""
    decodes = [s for s in run.steps if s.is_decode]
    all_readbacks = sum(s.readbacks for s in run.steps)
    metrics: dict[str, float] = {
        "steps": len(run.steps),
        "decode_steps": len(decodes),
        "readbacks_per_step": all_readbacks / len(run.steps) if run.steps else float("nan"),
    }
    if not decodes:
        return metrics
    decode_s = sum(s.seconds for s in decodes)
    rows = sum(s.rows for s in decodes)
    batch = rows / len(decodes)
    decode_flops = sum(cost.step_flops(s) for s in decodes)
    flops_per_step = decode_flops / len(decodes)
    memory_limit_s = cost.weight_bytes / (limits.read_gbs * 1e9)
    compute_limit_s = flops_per_step / (limits.peak_gflops * 1e9)
    step_s = decode_s / len(decodes)
    return metrics | {
        "readbacks_per_decode_step": sum(s.readbacks for s in decodes) / len(decodes),
        "mean_decode_batch": batch,
        "decode_step_ms": 1000 * step_s,
        "decode_step_median_ms": 1000 * percentile((s.seconds for s in decodes), 50),
        "decode_tokens_per_s": rows / decode_s,
        "achieved_read_gbs": cost.weight_bytes * len(decodes) / decode_s / 1e9,
        "achieved_gflops": decode_flops / decode_s / 1e9,
        "memory_limit_step_ms": 1000 * memory_limit_s,
        "compute_limit_step_ms": 1000 * compute_limit_s,
        "roofline_decode_tokens_per_s": batch / max(memory_limit_s, compute_limit_s),
        "roofline_fraction": max(memory_limit_s, compute_limit_s) / step_s,
        "bandwidth_fraction": cost.weight_bytes / step_s / (limits.read_gbs * 1e9),
    }


class EngineRunner:
    """One nanoserve `Engine`, its decode cost and its peak memory, run through `run_closed_loop`."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        self.cost = ModelCost.of_engine(self.engine)
        self.peak = PeakMemory(self.engine.device)

    def run(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], slots: int) -> RunRecord:
        self.peak.reset()
        stats = self.engine.stats
        drafted, accepted = stats.spec_draft_tokens, stats.spec_accepted_tokens
        run = run_closed_loop(self.engine, zip(prompts, params, strict=True), slots)
        run.peak_memory_mib = self.peak.peak_mib()
        run.spec_draft_tokens = stats.spec_draft_tokens - drafted
        run.spec_accepted_tokens = stats.spec_accepted_tokens - accepted
        return run


class TransformersRunner:
    """Hugging Face transformers' static-batch `generate` on the same model directory and workload."""

    def __init__(self, model_dir: Path, dtype: str, device: torch.device) -> None:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as err:
            raise RuntimeError(
                "--baseline transformers needs Hugging Face transformers: pip install -e '.[baseline]'"
            ) from err
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=_torch_dtype(dtype, torch.float32), attn_implementation="sdpa").to(device).eval()
        self.pad_token_id = self.model.config.eos_token_id
        if isinstance(self.pad_token_id, list):
            self.pad_token_id = self.pad_token_id[0]
        self.peak = PeakMemory(device)

    def supports(self, mix: str) -> bool:
        return mix in SAMPLING_SETTINGS  # generate takes one setting per batch: no per-row mix

    def run(self, prompts: Sequence[list[int]], mix: str, output_len: int, slots: int) -> RunRecord:
        """Batches of `slots` prompts, one `generate` each, every request held to `output_len` tokens."""
        self.peak.reset()
        requests = []
        start = time.perf_counter()
        for first in range(0, len(prompts), slots):
            batch = torch.tensor(prompts[first:first + slots], device=self.device)
            added = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(batch, attention_mask=torch.ones_like(batch),
                                          **self._generate_kwargs(mix, output_len))
            done = time.perf_counter()
            new_tokens = out.shape[1] - batch.shape[1]
            requests += [RequestTimes(added, finished_s=done, num_tokens=new_tokens)
                         for _ in range(batch.shape[0])]
        return RunRecord(time.perf_counter() - start, requests, [], self.peak.peak_mib())

    def _generate_kwargs(self, mix: str, output_len: int) -> dict[str, object]:
        settings = SAMPLING_SETTINGS[mix]
        kwargs: dict[str, object] = {"max_new_tokens": output_len, "min_new_tokens": output_len,
                                     "pad_token_id": self.pad_token_id}
        if settings["temperature"] == 0:
            return kwargs | {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        torch.manual_seed(SEED_BASE)
        # top_k=0 and top_p=1.0 switch those filters off (transformers' own default is top_k=50).
        return kwargs | {"do_sample": True, "temperature": settings["temperature"],
                         "top_p": settings.get("top_p", 1.0), "top_k": settings.get("top_k", 0),
                         "typical_p": settings.get("typical_p", 1.0)}


@dataclass(frozen=True, slots=True)
class SweepSpec:
    """A whole sweep: the cross product of these, each config run side by side with its baseline."""

    slots: tuple[int, ...] = (1, 2, 4, 8)
    params: tuple[str, ...] = ("greedy",)
    dtypes: tuple[str, ...] = ("float32",)
    batch_invariant: tuple[bool, ...] = (True,)
    prefix_caching: tuple[bool, ...] = (True,)
    speculative_tokens: tuple[int, ...] = (0,)
    async_scheduling: tuple[bool, ...] = (False,)
    baseline: str | None = None
    workload: Workload = Workload()
    model: str | None = None
    device: str | None = None
    threads: int | None = None
    linear_kernel: str | None = None
    tensor_parallel_size: int = 1  # every engine of the sweep (threads are per rank)
    kv_cache_dtype: str = "auto"  # every engine of the sweep
    prefill_step_ms: float | None = None  # every engine of the sweep; None: the device's pace

    def configs(self) -> list[BenchConfig]:
        """Interleaved, so a config and its baseline run next to each other in time."""
        configs = []
        for dtype, mix, slots in itertools.product(self.dtypes, self.params, self.slots):
            configs += [BenchConfig("nanoserve", slots, mix, dtype, inv, cache, spec, deferred)
                        for inv, cache, spec, deferred in itertools.product(
                            self.batch_invariant, self.prefix_caching, self.speculative_tokens,
                            self.async_scheduling)]
            if self.baseline and mix in BASELINE_MIXES:
                configs.append(BenchConfig(self.baseline, slots, mix, dtype))
        return configs


@dataclass
class SweepResult:
    machine: Machine
    limits: HardwareLimits
    frame: pd.DataFrame  # one row per config


ProgressCallback = Callable[[BenchConfig, int, int], None]


class Sweep:
    """Runs a `SweepSpec`: loads each engine once, probes the hardware, then every config in order."""

    def __init__(self, spec: SweepSpec) -> None:
        self.spec = spec
        self._engines: dict[tuple[str, bool, bool, int, bool], EngineRunner] = {}
        self._baselines: dict[str, TransformersRunner] = {}
        # Every run gets fresh prompts (only a shared prefix repeats), so no run hits the prefix
        # cache with prompts an earlier run left there.
        self._prompt_seeds = itertools.count()

    def engine(self, dtype: str, batch_invariant: bool, prefix_caching: bool = True,
               speculative_tokens: int = 0, async_scheduling: bool = False) -> EngineRunner:
        key = (dtype, batch_invariant, prefix_caching, speculative_tokens, async_scheduling)
        if key not in self._engines:
            w = self.spec.workload
            max_len = (w.input_len if w.prompts == "synthetic" else REPEAT_PROMPT_MAX_LEN) + w.output_len + 1
            self._engines[key] = EngineRunner(EngineConfig(
                model=self.spec.model, dtype=dtype, device=self.spec.device,
                max_num_seqs=max(self.spec.slots), max_model_len=max_len,
                num_kv_blocks=kv_blocks_for(max(self.spec.slots), max_len),
                max_num_batched_tokens=max(512, w.input_len * max(self.spec.slots)),
                batch_invariant=batch_invariant, threads=self.spec.threads,
                linear_kernel=self.spec.linear_kernel, enable_prefix_caching=prefix_caching,
                speculative_tokens=speculative_tokens, async_scheduling=async_scheduling,
                tensor_parallel_size=self.spec.tensor_parallel_size, kv_cache_dtype=self.spec.kv_cache_dtype,
                prefill_step_ms=self.spec.prefill_step_ms))
        return self._engines[key]

    def baseline(self, dtype: str) -> TransformersRunner:
        if dtype not in self._baselines:
            any_engine = next(iter(self._engines.values()))
            self._baselines[dtype] = TransformersRunner(any_engine.engine.model_dir, dtype,
                                                        any_engine.engine.device)
        return self._baselines[dtype]

    def run(self, progress: ProgressCallback | None = None) -> SweepResult:
        configs = self.spec.configs()
        for config in configs:  # load everything before timing anything
            if config.engine == "nanoserve":
                self._engine_of(config)
        # transformers runs dense weights only: no baseline beside an engine that runs GGUF blocks
        # (its figure would be another model's, dequantized, not a side-by-side comparison).
        blocks = {c.dtype for c in configs
                  if c.engine == "nanoserve" and self._engine_of(c).engine.model.weights.is_quantized()}
        configs = [c for c in configs if c.engine == "nanoserve" or c.dtype not in blocks]
        for config in configs:
            if config.engine != "nanoserve":
                self.baseline(config.dtype)
        first = next(iter(self._engines.values())).engine
        machine = describe_machine(first.device)
        limits = probe_limits(first.device, dtype=_torch_dtype(self.spec.dtypes[0], first.dtype),
                              rows=self.spec.slots,
                              kernel=first.kernel_choice.kernel)
        rows = []
        for group in _side_by_side(configs):
            if progress:
                progress(group[0], len(rows), len(configs))
            rows += self.run_group(group, limits)
        if progress:
            progress(configs[-1], len(configs), len(configs))
        frame = add_ratios(pd.DataFrame(rows))
        frame = frame.assign(**machine.columns(), **limits.columns(),
                             tensor_parallel_size=self.spec.tensor_parallel_size,
                             kv_cache_dtype=self.spec.kv_cache_dtype)
        return SweepResult(machine, limits, frame)

    def run_group(self, group: list[BenchConfig], limits: HardwareLimits) -> list[dict[str, object]]:
        """Configs compared with each other, warmed up, then timed in turns (A B A B, not A A B B),
        so a burst of load from elsewhere on the machine falls on both sides of a ratio."""
        w = self.spec.workload
        slots = group[0].slots
        warm_prompts = self._prompts(slots)
        load_avg = os.getloadavg()[0]
        for _ in range(w.warmup):
            for config in group:
                self.run_once(config, warm_prompts, min(8, w.output_len))
        runs: dict[BenchConfig, list[RunRecord]] = {config: [] for config in group}
        for _ in range(w.repeat):
            prompts = self._prompts(w.requests_for(slots))
            for config in group:
                runs[config].append(self.run_once(config, prompts, w.output_len))
        return [self.row(config, runs[config], limits) | {"load_avg_1m": load_avg} for config in group]

    def run_once(self, config: BenchConfig, prompts: list[list[int]], output_len: int) -> RunRecord:
        if config.engine != "nanoserve":
            return self.baseline(config.dtype).run(prompts, config.params, output_len, config.slots)
        ignore_eos = self.spec.workload.prompts == "synthetic"
        params = [sampling_params(config.params, i, output_len, ignore_eos=ignore_eos)
                  for i in range(len(prompts))]
        return self._engine_of(config).run(prompts, params, config.slots)

    def _engine_of(self, config: BenchConfig) -> EngineRunner:
        return self.engine(config.dtype, config.batch_invariant, config.prefix_caching,
                           config.speculative_tokens, config.async_scheduling)

    def _prompts(self, count: int) -> list[list[int]]:
        w = self.spec.workload
        if w.prompts == "repeat":
            tokenizer = next(iter(self._engines.values())).engine.tokenizer
            return repeat_prompts(tokenizer, count, seed=next(self._prompt_seeds))
        return synthetic_prompts(count, w.input_len, self._vocab_size(), seed=next(self._prompt_seeds),
                                 shared_prefix_len=w.shared_prefix_len)

    def row(self, config: BenchConfig, runs: list[RunRecord], limits: HardwareLimits) -> dict[str, object]:
        w = self.spec.workload
        run = _median_run(runs)
        figures = request_metrics(run)
        if config.engine == "nanoserve":
            runner = self._engine_of(config)
            figures |= step_metrics(run, runner.cost, limits) | runner.engine.kernel_choice.columns()
            figures |= {"weight_format": runner.engine.weight_format,
                        "weight_mb": runner.engine.weights_nbytes / 1e6}
            figures |= grammar_columns(runner.engine)
        return {
            "engine": config.engine, "slots": config.slots, "params": config.params, "dtype": config.dtype,
            "batch_invariant": config.batch_invariant, "prefix_caching": config.prefix_caching,
            "speculative_tokens": config.speculative_tokens, "async_scheduling": config.async_scheduling,
            "prompts": w.prompts,
            "spec_draft_tokens": run.spec_draft_tokens, "spec_accepted_tokens": run.spec_accepted_tokens,
            # Every turn's tokens, not the median run's: each turn draws new prompts, and two
            # configs' median runs can come from different turns.
            "output_digest": hashlib.sha256(
                " ".join(r.output_digest for r in runs).encode()).hexdigest()[:16],
            "shared_prefix_len": w.shared_prefix_len, "input_len": w.input_len,
            "output_len": w.output_len, "repeat": w.repeat,
            "tokens_per_s_runs": " ".join(f"{r.tokens_per_s:.2f}" for r in runs),
            "gemm_gflops_at_slots": limits.gflops_by_rows.get(config.slots, float("nan")),
            **figures,
        }

    def _vocab_size(self) -> int:
        return next(iter(self._engines.values())).engine.vocab_size


def grammar_columns(engine: Engine) -> dict[str, float]:
    """Grammar compiles since the engine started, their time and the cache hits: one compile
    per distinct schema however many requests use it."""
    stats = engine.grammars.stats
    return {"grammar_compiles": stats.compiles, "grammar_compile_ms": 1000 * stats.compile_s,
            "grammar_cache_hits": stats.hits}


def _side_by_side(configs: list[BenchConfig]) -> list[list[BenchConfig]]:
    """Consecutive configs sharing slots, params and dtype: the ones whose ratios are reported."""
    return [list(g) for _, g in itertools.groupby(configs, key=lambda c: (c.slots, c.params, c.dtype))]


def _median_run(runs: Sequence[RunRecord]) -> RunRecord:
    return sorted(runs, key=lambda r: r.tokens_per_s)[(len(runs) - 1) // 2]


KEY = ["slots", "params", "dtype"]
ROW_KEY = ["engine", *KEY, "batch_invariant", "prefix_caching", "speculative_tokens", "async_scheduling"]


def merge_rows(old: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """`old` without the configurations `new` measured again, plus `new`, in sweep order (--append)."""
    if "prefix_caching" not in old:
        old = old.assign(prefix_caching=True)  # written before the prefix cache existed
    if "speculative_tokens" not in old:
        old = old.assign(speculative_tokens=0)  # written before speculative decoding existed
    if "async_scheduling" not in old:
        old = old.assign(async_scheduling=False)  # written before deferred output existed
    remeasured = pd.MultiIndex.from_frame(new[ROW_KEY])
    kept = old[~pd.MultiIndex.from_frame(old[ROW_KEY]).isin(remeasured)]
    merged = pd.concat([kept, new], ignore_index=True)
    mix_order = {mix: i for i, mix in enumerate(PARAM_MIXES)}
    return merged.sort_values(["dtype", "params", "slots"], kind="stable", ignore_index=True,
                              key=lambda c: c.map(mix_order) if c.name == "params" else c)


def add_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """Side-by-side ratios: nanoserve over the baseline, and batch-invariant over plain kernels."""
    frame = frame.copy()
    plain_rows = (frame.engine == "nanoserve") & ~frame.batch_invariant.astype(bool)
    frame["ratio_to_baseline"] = _ratio(frame, frame.engine != "nanoserve")
    frame.loc[frame.engine != "nanoserve", "ratio_to_baseline"] = float("nan")
    frame["ratio_to_plain_kernels"] = _ratio(frame, plain_rows)
    frame.loc[frame.engine != "nanoserve", "ratio_to_plain_kernels"] = float("nan")
    if "speculative_tokens" in frame:
        plain_decoding = (frame.engine == "nanoserve") & (frame.speculative_tokens == 0)
        _against(frame, plain_decoding, "no_speculation")
    if "async_scheduling" in frame:
        resolved_at_once = (frame.engine == "nanoserve") & ~frame.async_scheduling.astype(bool)
        _against(frame, resolved_at_once, "sync_output")
    return frame


def _against(frame: pd.DataFrame, reference_rows: pd.Series, name: str) -> None:
    """Columns ratio_to_<name> and same_tokens_as_<name>: each nanoserve row's throughput over,
    and its tokens against, the reference row of its slots/params/dtype; and
    decode_ratio_to_<name>, the same for decoding alone (the reference's median time per output
    token after the first over this row's: the prefill, which neither side speeds up, left out)."""
    frame[f"ratio_to_{name}"] = _ratio(frame, reference_rows)
    frame.loc[frame.engine != "nanoserve", f"ratio_to_{name}"] = float("nan")
    if "tpot_median_ms" in frame:
        _decode_ratio(frame, reference_rows, name)
    reference = frame[reference_rows].drop_duplicates(KEY).set_index(KEY)["output_digest"]
    frame[f"same_tokens_as_{name}"] = [
        digest == reference.get(tuple(key), None) for key, digest in
        zip(frame[KEY].itertuples(index=False), frame["output_digest"], strict=True)]


def _decode_ratio(frame: pd.DataFrame, reference_rows: pd.Series, name: str) -> None:
    reference = frame[reference_rows].drop_duplicates(KEY).set_index(KEY)["tpot_median_ms"]
    frame[f"decode_ratio_to_{name}"] = [
        reference.get(tuple(key), float("nan")) / tpot if engine == "nanoserve" else float("nan")
        for key, tpot, engine in zip(frame[KEY].itertuples(index=False), frame["tpot_median_ms"],
                                     frame["engine"], strict=True)]


def _ratio(frame: pd.DataFrame, reference_rows: pd.Series) -> pd.Series:
    reference = frame[reference_rows].drop_duplicates(KEY).set_index(KEY)
    ratios = []
    for row in frame.itertuples(index=False):
        key = tuple(getattr(row, k) for k in KEY)
        ratios.append(paired_ratio(row, reference.loc[key]) if key in reference.index else float("nan"))
    return pd.Series(ratios, index=frame.index, dtype=float)


def paired_ratio(row: object, reference: object) -> float:
    """Median over repeats of (this run / the reference's run of the same turn), which cancels a
    load burst that hit both; the ratio of the two medians when the runs are not recorded."""
    ours, theirs = _runs(row), _runs(reference)
    if ours and len(ours) == len(theirs):
        return percentile((a / b for a, b in zip(ours, theirs, strict=True)), 50)
    return row.output_tokens_per_s / reference.output_tokens_per_s


def _runs(row: object) -> list[float]:
    text = getattr(row, "tokens_per_s_runs", None)
    return [float(v) for v in text.split()] if isinstance(text, str) and text else []


def parse_int_list(text: str, *, minimum: int = 1) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); ValueError naming the bad item."""
    values = []
    for item in _items(text):
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{item!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"{value} is below {minimum}")
        values.append(value)
    return tuple(values)


def positive_int_list(text: str) -> tuple[int, ...]:
    """`parse_int_list` as an argparse `type=`: a bad item is an error naming the option (exit 2)."""
    try:
        return parse_int_list(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_choice_list(text: str, choices: Iterable[str]) -> tuple[str, ...]:
    choices = tuple(choices)
    values = _items(text)
    bad = [v for v in values if v not in choices]
    if bad:
        raise ValueError(f"{', '.join(map(repr, bad))} not among {', '.join(choices)}")
    return values


def _items(text: str) -> tuple[str, ...]:
    items = tuple(item.strip() for item in text.split(","))
    if not items or any(not item for item in items):
        raise ValueError(f"{text!r} is not a comma-separated list")
    return items
