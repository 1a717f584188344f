"""Building one rank: its device and dtype, its weights (a shard of them with tensor
parallelism), its linear kernel, its model and its KV cache; and a tensor-parallel worker's life.

Rank 0 and every worker build their rank the same way, in three steps:

    load_rank_weights  the checkpoint this rank runs (its shard), in the blocks or dtype asked for
    RankPlan           what rank 0 decides once for every rank: the measured kernel, the KV
                       blocks the memory budget allows, the context (`plan_rank`); a worker
                       receives it from rank 0 (`TensorParallelGroup.receive_plan`)
    Rank.build         the model and KV cache of that shard to that plan

so every rank runs one kernel and holds as many KV blocks, and no rank can build something
another did not. The engine (`nanoserve.engine.core`) owns the request lifecycle above this.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve import native
from nanoserve.config import DTYPES, QUANTIZED, EngineConfig, ModelConfig
from nanoserve.distributed import group as tp_group
from nanoserve.distributed.collectives import Collectives
from nanoserve.distributed.group import RankPlan, TensorParallelGroup, WorkerSpec
from nanoserve.distributed.shards import Shard, local_config
from nanoserve.errors import InvalidRequestError
from nanoserve.loading.default_model import ModelSource, resolve_model
from nanoserve.loading.weights import load_weights, read_config
from nanoserve.machine import cache_root
from nanoserve.model.decoder import LOOP_NATIVE_OPS_PER_LAYER, DecoderLM
from nanoserve.model.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget, resolve_kv_cache_dtype
from nanoserve.model.linear import KernelChoice, KernelUnavailableError, choose_kernel, kernel_named
from nanoserve.model.weights import LlamaWeights
from nanoserve.native import ops as native_ops
from nanoserve.quant import QUANTIZERS, format_names

log = logging.getLogger("nanoserve")

# Like vLLM's CPU backend (4 GiB): the cache is zeroed at start, and host RAM is shared with
# everything else, so a fraction of free memory alone would make start-up slow and greedy.
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
    """Pin torch's CPU thread count (process-wide): the kernel choice is measured at it."""
    if threads is not None and threads < 1:
        raise InvalidRequestError(f"threads must be at least 1; got {threads}", param="threads")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads or cores)
    return torch.get_num_threads()


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


def loop_overhead_ms(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> float:
    """What a forward through the per-layer loop costs beyond its linears, where this model
    could run the one-call decoder instead (the stack `DecoderLM._native_decoder` takes) and a
    kernel is to be chosen (else 0): the loop's native small-op calls a forward, each timed here
    as a one-row RMSNorm call (Python, the checks, ctypes, the pool). The best of several short
    batches, as the kernels' figures are their best turns, so a neighbour's stall is discarded."""
    ops = native_ops.load()
    if (config.linear_kernel is not None or ops is None or device.type != "cpu"
            or config.tensor_parallel_size > 1 or not model_config.is_llama_stack):
        return 0.0
    x = torch.randn(1, model_config.hidden_size)
    weight, out = torch.ones(model_config.hidden_size), torch.empty_like(x)
    batches, calls = 10, 20
    for _ in range(calls):
        ops.rms_norm(x, weight, 1e-6, out)
    best_s = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            ops.rms_norm(x, weight, 1e-6, out)
        best_s = min(best_s, time.perf_counter() - start)
    per_call_ms = 1e3 * best_s / calls
    return per_call_ms * LOOP_NATIVE_OPS_PER_LAYER * model_config.num_layers


def choose_rank_kernel(config: EngineConfig, model_config: ModelConfig, weights: LlamaWeights,
                       device: torch.device) -> KernelChoice:
    """The linear kernel every rank runs, measured on this rank's weights (or forced)."""
    try:
        choice = choose_kernel(weights.probe_shape(), device=device, max_rows=config.max_num_seqs,
                               prefill_rows=config.max_num_batched_tokens,
                               batch_invariant=config.batch_invariant, forced=config.linear_kernel,
                               cache_path=cache_root() / "linear_kernels.json",
                               loop_overhead_ms=loop_overhead_ms(config, model_config, device))
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
class Rank:
    """One rank's model (its shard, with its collectives) and its KV cache."""

    model: DecoderLM
    kv_cache: KVCache

    @classmethod
    def build(cls, config: EngineConfig, model_config: ModelConfig, weights: LlamaWeights, plan: RankPlan, *,
              dtype: torch.dtype, device: torch.device, collectives: Collectives | None = None) -> Rank:
        local = local_config(model_config, config.tensor_parallel_size)
        cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
        model = DecoderLM(local, weights, batch_invariant=config.batch_invariant,
                          linear_kernel=kernel_named(plan.kernel_name), max_positions=plan.max_positions,
                          tensor_parallel=collectives, kv_cache_dtype=cache_dtype)
        return cls(model, KVCache(local, plan.num_blocks, config.block_size, dtype, device, cache_dtype))


def start_tensor_parallel(config: EngineConfig, source: ModelSource,
                          device: torch.device) -> TensorParallelGroup | None:
    """Rank 0's group with its local workers started (None with one rank). Under torchrun a
    process of rank > 0 serves as a worker here and exits: it never returns to its caller."""
    group = tp_group.start(config, read_config(source.dir), model_dir=source.dir,
                           gguf=blocks_file(config, source, device), device=device)
    if group is not None and group.shard.rank != 0:
        sys.exit(serve_worker(group.spec, group))
    return group


def serve_worker(spec: WorkerSpec, group: TensorParallelGroup) -> int:
    """A worker's life: load its shard, build its rank to rank 0's plan, then run every step
    rank 0 sends until it says stop. Returns the exit status."""
    with tp_group.heartbeat(group):
        return _serve_worker(spec, group)


def _serve_worker(spec: WorkerSpec, group: TensorParallelGroup) -> int:
    config = EngineConfig(**spec.engine)
    set_threads(spec.threads)
    dtype = pick_dtype(config.dtype, group.device)
    gguf = Path(spec.gguf) if spec.gguf else None
    model_config, weights = load_rank_weights(config, Path(spec.model_dir), gguf, dtype, group.device,
                                              group.shard, [])
    rank = Rank.build(config, model_config, weights, group.receive_plan(), dtype=dtype, device=group.device,
                      collectives=group.make_collectives(model_config, config.batch_invariant))
    try:
        while (batch := group.receive_batch()) is not None:
            group.send_logits(rank.model.forward(batch, rank.kv_cache))
    except RuntimeError as error:
        print(f"nanoserve: tensor-parallel rank {group.shard.rank}: lost the group ({error}); exiting",
              file=sys.stderr, flush=True)
        return 1
    return 0
