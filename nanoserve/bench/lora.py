"""The multi-LoRA bench: requests spread over several adapters against the same requests with
none, output tokens/s side by side.

Owns: random PEFT adapters written for the model at bench time (`write_random_adapter`: every
target module, A and B drawn at the scale a trained adapter's update has, so nothing is
downloaded), the workload (`requests` prompts of `input_len` token ids, each decoding
`output_len` tokens greedily, request i on adapter i mod `adapters`), and the turns: in each,
the base run and the LoRA run one after the other, their order alternating from turn to turn
so a neighbour's load falls on both alike; the ratio is taken per turn and its median
reported. The prefix cache is off: the runs would otherwise hit different amounts of it.
Refuses: printing and file formats (the CLI does those), and timing anything but whole
`LLM.generate` calls.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from nanoserve.bench.hardware import describe_machine
from nanoserve.config import ModelConfig
from nanoserve.llm import LLM
from nanoserve.model.lora import TARGETS, LoRARequest
from nanoserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class LoRABenchSpec:
    model: str | None = None  # None: the default model
    dtype: str = "auto"
    adapters: int = 4
    requests: int = 16
    rank: int = 16
    input_len: int = 64
    output_len: int = 64
    turns: int = 3
    threads: int | None = None
    linear_kernel: str | None = None  # None: the kernel the engine measures at start-up


@dataclass(frozen=True, slots=True)
class TurnResult:
    turn: int
    first: str  # which run went first: "base" or "lora"
    base_tokens_per_s: float
    lora_tokens_per_s: float
    load_avg_1m: float  # when the turn started: above the cores, neighbours shared its time

    @property
    def ratio(self) -> float:
        return self.lora_tokens_per_s / self.base_tokens_per_s


def write_random_adapter(folder: Path, model: ModelConfig, *, rank: int, seed: int) -> Path:
    """A PEFT adapter folder of rank `rank` on every target module, A and B random."""
    generator = torch.Generator().manual_seed(seed)
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    shapes = {"q_proj": (model.hidden_size, q), "k_proj": (model.hidden_size, kv),
              "v_proj": (model.hidden_size, kv), "o_proj": (q, model.hidden_size),
              "gate_proj": (model.hidden_size, model.intermediate_size),
              "up_proj": (model.hidden_size, model.intermediate_size),
              "down_proj": (model.intermediate_size, model.hidden_size)}
    tensors = {}
    for layer in range(model.num_layers):
        for module, (width_in, width_out) in shapes.items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, width_in, generator=generator) / width_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(width_out, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS),
              "bias": "none", "use_rslora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def run_lora_bench(spec: LoRABenchSpec, adapter_root: Path, *,
                   on_turn: Callable[[TurnResult], None] | None = None
                   ) -> tuple[list[TurnResult], dict[str, object]]:
    """The turns (each also handed to `on_turn` as it ends), and the machine and engine they
    ran on (a row's columns)."""
    llm = LLM(spec.model, dtype=spec.dtype, enable_lora=True, max_loras=spec.adapters,
              max_lora_rank=spec.rank, max_num_seqs=max(spec.requests, 1), enable_prefix_caching=False,
              threads=spec.threads, linear_kernel=spec.linear_kernel)
    engine = llm.engine
    loras = [LoRARequest(f"bench-{i}", i + 1, str(write_random_adapter(
        adapter_root / f"adapter-{i}", engine.model_config, rank=spec.rank, seed=i)))
        for i in range(spec.adapters)]
    per_request = [loras[i % spec.adapters] for i in range(spec.requests)]
    prompts = [{"prompt_token_ids": [(7 + 31 * i + 17 * j) % engine.vocab_size
                                     for j in range(spec.input_len)]} for i in range(spec.requests)]
    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)

    def tokens_per_s(lora: list[LoRARequest] | None) -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=lora, progress=False)
        seconds = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds

    tokens_per_s(None)  # warm-up: kernels chosen, caches touched, for both runs
    tokens_per_s(per_request)
    turns = []
    for turn in range(spec.turns):
        load = os.getloadavg()[0]
        if turn % 2 == 0:
            base, lora, first = tokens_per_s(None), tokens_per_s(per_request), "base"
        else:
            lora, base, first = tokens_per_s(per_request), tokens_per_s(None), "lora"
        turns.append(TurnResult(turn, first, base, lora, load))
        if on_turn is not None:
            on_turn(turns[-1])
    setup = describe_machine(engine.device).columns() | {
        "model": spec.model or "default", "weight_format": engine.weight_format,
        "linear_kernel": engine.kernel_choice.kernel.name, "adapters": spec.adapters,
        "requests": spec.requests, "rank": spec.rank, "input_len": spec.input_len,
        "output_len": spec.output_len}
    return turns, setup


def median_ratio(turns: list[TurnResult]) -> float:
    return statistics.median(turn.ratio for turn in turns)
