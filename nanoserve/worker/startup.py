"""Rank 0's start-up policy, the one place every rank reads it from: the device, the dtype of
activations and the KV cache, the CPU threads, the checkpoint and how its weights load, the
linear kernel (measured, or forced) and the KV blocks the memory budget allows.

    Startup.decide   what rank 0 decides before anything loads (refused here where the options
                     cannot run), before any worker starts
    load_rank_weights  the checkpoint a rank runs (its shard), in the blocks or dtype asked for
    plan_rank        the `RankPlan` rank 0 decides once for every rank: the kernel, the KV
                     blocks, the context; a worker receives it (`TensorParallelGroup.receive_plan`)
    StartupPhases    how long each phase of rank 0's start took, for the start-up line and
                     `nanoserve.bench.startup`

A worker takes the threads and the dtype from the same functions (`nanoserve.worker.loop`), so no
rank decides differently. Building a rank to a plan is `nanoserve.worker.rank`; starting and
stopping ranks is the executor's (`nanoserve.engine.executor`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanoserve import native
from nanoserve.config import DTYPES, QUANTIZED, EngineConfig, ModelConfig
from nanoserve.distributed.group import RankPlan, cores, local_ranks
from nanoserve.distributed.shards import Shard, local_config
from nanoserve.errors import InvalidRequestError
from nanoserve.loading.default_model import ModelSource, resolve_model
from nanoserve.loading.weights import load_weights
from nanoserve.machine import cache_root
from nanoserve.model.decoder import LOOP_NATIVE_OPS_PER_LAYER
from nanoserve.model.kv_cache import bytes_per_block, num_blocks_for_budget, resolve_kv_cache_dtype
from nanoserve.model.linear import KernelChoice, KernelUnavailableError, choose_kernel
from nanoserve.model.weights import LlamaWeights
from nanoserve.native import ops as native_ops
from nanoserve.quant import QUANTIZERS, format_names

log = logging.getLogger("nanoserve")

# Like vLLM's CPU backend (4 GiB): host RAM is shared with everything else, and the cache's
# pages are taken as requests first write them (`kv_cache.zero_filled`), so a fraction of free
# memory alone would let a long-running engine grow into memory others have since taken.
CPU_DEFAULT_KV_CACHE_BYTES = 4 << 30


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device 'cuda' asked for, but torch sees no CUDA GPU", param="device")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype of activations and the KV cache (float32 for quantized weights)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == QUANTIZED:
        return torch.float32
    if name not in DTYPES:
        raise InvalidRequestError(f"dtype {name!r} is not one of {sorted(DTYPES)}, {QUANTIZED!r} or 'auto'",
                                  param="dtype")
    return getattr(torch, name)


def check_quantize(config: EngineConfig, device: torch.device) -> None:
    """--quantize: a known format, float32 activations, on the CPU (before any model loads)."""
    if config.quantize is None:
        return
    if config.quantize not in QUANTIZERS:
        raise InvalidRequestError(f"{config.quantize!r} is not a format nanoserve quantizes to; choose "
                                  f"from {', '.join(QUANTIZERS)}", param="quantize")
    if config.dtype not in ("auto", "float32") or device.type != "cpu":
        raise InvalidRequestError("quantized weights run on the CPU with float32 activations; drop "
                                  f"--dtype {config.dtype} or --device {device.type}", param="quantize")


def wants_blocks(config: EngineConfig, device: torch.device) -> bool:
    """Whether a GGUF model should keep its blocks (rather than load float weights)."""
    if device.type != "cpu" or config.quantize is not None:
        return False
    return config.dtype == QUANTIZED or (config.dtype == "auto" and native.library() is not None)


def set_threads(threads: int | None) -> int:
    """This process's CPU threads, the count every native call of the rank is passed (the
    kernel choice is measured at it); torch's pool is pinned to it too, process-wide, for
    torch's own kernels."""
    if threads is not None and threads < 1:
        raise InvalidRequestError(f"threads must be at least 1; got {threads}", param="threads")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads or cores)
    return torch.get_num_threads()


def rank_threads(config: EngineConfig) -> int | None:
    """CPU threads of each rank: --threads, else the cores divided among the local ranks."""
    ranks = local_ranks(config)
    if config.threads is not None or ranks == 1:
        return config.threads
    return max(1, cores() // ranks)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def resolve_source(config: EngineConfig, device: torch.device, notes: list[str]) -> ModelSource:
    """The model's checkpoint, refused before anything loads where the options cannot run it;
    `notes` hears how its weights will load."""
    check_quantize(config, device)
    blocks = wants_blocks(config, device)
    source = resolve_model(config.model, float_weights=not blocks)
    if config.quantize is not None and source.gguf is not None:
        raise InvalidRequestError(f"{source.gguf.name} is a GGUF model, already quantized; drop "
                                  "--quantize (the file runs in its own quantization by default)",
                                  param="quantize")
    if config.dtype == QUANTIZED and source.gguf is None:
        raise InvalidRequestError(f"{QUANTIZED!r} runs a GGUF file's own blocks, and {source.dir} is a "
                                  "float checkpoint; quantize it with --quantize q8_0 or q4_0",
                                  param="dtype")
    if source.gguf is not None and not blocks and device.type == "cpu" and config.dtype == "auto":
        notes.append(f"weights: {source.gguf.name} dequantized to float32 at load "
                     "(the native kernels that run its blocks are off)")
    return source


def blocks_file(config: EngineConfig, source: ModelSource, device: torch.device) -> Path | None:
    """The GGUF file whose blocks the weights are read from, if they are."""
    return source.gguf if wants_blocks(config, device) else None


def load_rank_weights(config: EngineConfig, model_dir: Path, gguf: Path | None, dtype: torch.dtype,
                      device: torch.device, shard: Shard | None,
                      notes: list[str]) -> tuple[ModelConfig, LlamaWeights]:
    """The weights this process runs (a rank's shard with `shard`), quantized by --quantize, and
    dequantized where no native kernel runs their blocks; `notes` hears how, in one line each."""
    model_config, weights = load_weights(model_dir, dtype=dtype, device=device, gguf=gguf,
                                         log_line=notes.append, shard=shard)
    if config.quantize is not None:
        weights = weights.quantized(config.quantize)
    if weights.is_quantized() and native.library() is None:
        notes.append(f"weights: {weight_format(weights)} dequantized to float32 at load "
                     "(the native kernels that run its blocks are off)")
        weights = weights.dequantized()
    elif weights.is_quantized():
        notes.append(f"weights: {weight_format(weights)} blocks, {weights.nbytes() / 1e6:.1f} MB")
    return model_config, weights


def weight_format(weights: LlamaWeights) -> str:
    """How the matrices are held: 'q4_1+q8_0' (layers' formats, then the head's), or a dtype."""
    names = [n for m in [*weights.layers[0].matrices(), weights.lm_head] for n in format_names(m)]
    return "+".join(dict.fromkeys(names))


def loop_overhead_ms(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                     threads: int) -> float:
    """What a forward through the per-layer loop costs beyond its linears, where this model
    could run the one-call decoder instead (the stack `DecoderLM._native_decoder` takes) and a
    kernel is to be chosen (else 0): the loop's native small-op calls a forward, each timed here
    as a one-row RMSNorm call (Python, the checks, ctypes, the pool). The best of several short
    batches, as the kernels' figures are their best turns, so a neighbour's stall is discarded."""
    ops = native_ops.load()
    if (config.linear_kernel is not None or ops is None or device.type != "cpu"
            or config.tensor_parallel_size > 1 or not model_config.runs_in_one_call):
        return 0.0
    x = torch.randn(1, model_config.hidden_size)
    weight, out = torch.ones(model_config.hidden_size), torch.empty_like(x)
    batches, calls = 10, 20
    for _ in range(calls):
        ops.rms_norm(x, weight, 1e-6, out, threads=threads)
    best_s = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            ops.rms_norm(x, weight, 1e-6, out, threads=threads)
        best_s = min(best_s, time.perf_counter() - start)
    per_call_ms = 1e3 * best_s / calls
    return per_call_ms * LOOP_NATIVE_OPS_PER_LAYER * model_config.num_layers


def choose_rank_kernel(config: EngineConfig, model_config: ModelConfig, weights: LlamaWeights,
                       device: torch.device, threads: int) -> KernelChoice:
    """The linear kernel every rank runs, measured on this rank's weights (or forced) at `threads`."""
    try:
        choice = choose_kernel(weights.probe_shape(), device=device, max_rows=config.max_num_seqs,
                               prefill_rows=config.max_num_batched_tokens,
                               batch_invariant=config.batch_invariant, forced=config.linear_kernel,
                               cache_path=cache_root() / "linear_kernels.json",
                               loop_overhead_ms=loop_overhead_ms(config, model_config, device, threads),
                               threads=threads)
    except KernelUnavailableError as error:
        raise InvalidRequestError(str(error), param=error.option) from error
    if config.batch_invariant and not choice.batch_invariant:
        log.warning("no batch-invariant linear kernel on this machine: a request's tokens may "
                    "depend on what shares its steps")
    return choice


def num_kv_blocks(config: EngineConfig, local: ModelConfig, dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> int:
    """KV blocks of one rank (`local`: its shard's config, so its K/V heads only): the asked
    number, else what the memory budget holds, capped by what every sequence at full length uses."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = (config.kv_cache_gb * 2**30 if config.kv_cache_gb is not None
              else config.kv_cache_fraction * available_memory_bytes(device))
    if config.kv_cache_gb is None and device.type == "cpu":
        budget = min(budget, CPU_DEFAULT_KV_CACHE_BYTES)
    useful = config.max_num_seqs * max_model_len
    cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    per_block = bytes_per_block(local, config.block_size, cache_dtype)
    wanted = min(int(budget), -(-useful // config.block_size) * per_block)
    return num_blocks_for_budget(local, config.block_size, cache_dtype, wanted)




@dataclass(slots=True)
class StartupPhases:
    """Seconds each phase of an engine's start took, in the order they ran."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    @property
    def summary(self) -> str:
        """The start-up line: 'start-up: 2.41 s (model files 0.05 s, weights 0.74 s, ...)'."""
        total = sum(self.seconds.values())
        parts = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.seconds.items())
        return f"start-up: {total:.2f} s ({parts})"


@dataclass(slots=True)
class Startup:
    """What rank 0 decides before any weight loads or any worker starts: the device, the dtype
    of activations and the KV cache, this process's CPU threads (set process-wide), the native
    kernels' status, the checkpoint and the GGUF file whose blocks it runs (if it does);
    `notes` hears how the weights load, one line each; `phases` how long each phase of the
    start took, this one included."""

    device: torch.device
    dtype: torch.dtype
    threads: int
    native_summary: str
    source: ModelSource
    gguf: Path | None
    notes: list[str]
    phases: StartupPhases

    @classmethod
    def decide(cls, config: EngineConfig) -> Startup:
        phases = StartupPhases()
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)  # refused before any load
        threads = set_threads(rank_threads(config))
        with phases.timed("native kernels"):
            # Built (or found in the cache) before the weights load: the kernel choice may use it.
            native_summary = native.status()
        notes: list[str] = []
        with phases.timed("model files"):
            source = resolve_source(config, device, notes)
        return cls(device, dtype, threads, native_summary, source, blocks_file(config, source, device), notes,
                   phases)


def max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context: --max-model-len, capped by the model's positions."""
    return min(config.max_model_len or model_config.max_position_embeddings,
               model_config.max_position_embeddings)


def plan_rank(config: EngineConfig, model_config: ModelConfig, weights: LlamaWeights,
              startup: Startup) -> tuple[KernelChoice, RankPlan]:
    """Rank 0's plan for every rank: the kernel measured on its weights (or forced), the KV
    blocks of one rank's shard, the context."""
    choice = choose_rank_kernel(config, model_config, weights, startup.device, startup.threads)
    context = max_model_len(config, model_config)
    local = local_config(model_config, config.tensor_parallel_size)
    blocks = num_kv_blocks(config, local, startup.dtype, startup.device, context)
    return choice, RankPlan(choice.kernel.name, blocks, context)
