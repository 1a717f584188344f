"""A mixture of experts against the dense model of the same active size: decode speed, side by side.

Owns: writing the pair of random-weight checkpoints (SmolLM2-135M's shape, the default model:
a Llama stack; and Mixtral's block on the same stack, `experts` experts of which `top_k` run
per row, each `dense width / top_k` wide, so a row multiplies exactly the dense model's
weights), and timing their decode in alternating turns (dense, MoE, dense, MoE...) at each
slot count, so load from elsewhere on the machine falls on both sides of every ratio; the
ratio per turn and their median.
Refuses: printing and file formats (`nanoserve bench moe` writes the CSV).

Random weights decode as fast as trained ones (every step does the same work); only the
routing differs: a random router spreads a crowd's rows over the experts about evenly, as a
trained one is trained to do (its load-balancing loss).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import save_file

from nanoserve.bench.driver import RunRecord
from nanoserve.bench.hardware import describe_machine
from nanoserve.bench.offline import EngineRunner, kv_blocks_for, sampling_params, synthetic_prompts
from nanoserve.config import EngineConfig

# SmolLM2-135M (the default model): what the dense side is, and the MoE's attention and embedding.
DENSE_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
               "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
               "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
INIT_STD = 0.02  # transformers' initializer_range


@dataclass(frozen=True, slots=True)
class MoEShape:
    experts: int = 8
    top_k: int = 2

    def expert_width(self) -> int:
        width, left = divmod(DENSE_SHAPE["intermediate_size"], self.top_k)
        if left:
            raise ValueError(f"top_k {self.top_k} does not divide the dense width "
                             f"{DENSE_SHAPE['intermediate_size']}")
        return width


def _random(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * INIT_STD


def _attention_and_norms(layer: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    s = DENSE_SHAPE
    hidden, head_dim = s["hidden_size"], s["hidden_size"] // s["num_attention_heads"]
    p = f"model.layers.{layer}."
    return {p + "self_attn.q_proj.weight": _random((hidden, hidden), generator),
            p + "self_attn.k_proj.weight": _random((s["num_key_value_heads"] * head_dim, hidden), generator),
            p + "self_attn.v_proj.weight": _random((s["num_key_value_heads"] * head_dim, hidden), generator),
            p + "self_attn.o_proj.weight": _random((hidden, hidden), generator),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden)}


def _mlp(prefix: str, names: tuple[str, str, str], width: int, generator: torch.Generator) -> dict:
    hidden = DENSE_SHAPE["hidden_size"]
    gate, up, down = names
    return {f"{prefix}{gate}.weight": _random((width, hidden), generator),
            f"{prefix}{up}.weight": _random((width, hidden), generator),
            f"{prefix}{down}.weight": _random((hidden, width), generator)}


def _write(path: Path, config: dict, layer_mlp: Callable[[int], dict], tokenizer_dir: Path) -> Path:
    generator = torch.Generator().manual_seed(0)
    s = DENSE_SHAPE
    tensors = {"model.embed_tokens.weight": _random((s["vocab_size"], s["hidden_size"]), generator),
               "model.norm.weight": torch.ones(s["hidden_size"])}
    for layer in range(s["num_hidden_layers"]):
        tensors |= _attention_and_norms(layer, generator) | layer_mlp(layer)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def write_pair(root: Path, shape: MoEShape, tokenizer_dir: Path) -> tuple[Path, Path]:
    """(dense, moe) checkpoint directories under `root`, written once (a second call reuses them)."""
    width = shape.expert_width()
    dense_dir, moe_dir = root / "dense", root / f"mixtral-{shape.experts}x{width}-top{shape.top_k}"
    generator = torch.Generator().manual_seed(1)
    if not (dense_dir / "config.json").is_file():
        _write(dense_dir, {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **DENSE_SHAPE},
               lambda layer: _mlp(f"model.layers.{layer}.mlp.", ("gate_proj", "up_proj", "down_proj"),
                                  DENSE_SHAPE["intermediate_size"], generator), tokenizer_dir)
    if not (moe_dir / "config.json").is_file():
        config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **DENSE_SHAPE,
                  "intermediate_size": width, "num_local_experts": shape.experts,
                  "num_experts_per_tok": shape.top_k}

        def sparse(layer: int) -> dict:
            p = f"model.layers.{layer}.block_sparse_moe."
            router = {p + "gate.weight": _random((shape.experts, DENSE_SHAPE["hidden_size"]), generator)}
            for e in range(shape.experts):
                router |= _mlp(f"{p}experts.{e}.", ("w1", "w3", "w2"), width, generator)
            return router

        _write(moe_dir, config, sparse, tokenizer_dir)
    return dense_dir, moe_dir


@dataclass(frozen=True, slots=True)
class ComparisonSpec:
    slots: tuple[int, ...] = (1, 16)
    turns: int = 3
    input_len: int = 32
    output_len: int = 64
    dtype: str = "float32"
    quantize: str | None = None  # q8_0 or q4_0: both models' matrices in blocks, as --quantize
    threads: int | None = None
    # One kernel for both sides (None: each engine's start-up measurement picks its own, which
    # under load can pick one the one-call decoder does not run; the CSV names both).
    linear_kernel: str | None = None
    shape: MoEShape = MoEShape()


def _engine(path: Path, spec: ComparisonSpec) -> EngineRunner:
    slots, max_len = max(spec.slots), spec.input_len + spec.output_len + 1
    return EngineRunner(EngineConfig(
        model=str(path), dtype=spec.dtype, device="cpu", max_num_seqs=slots, max_model_len=max_len,
        num_kv_blocks=kv_blocks_for(slots, max_len), max_num_batched_tokens=max(512, spec.input_len * slots),
        batch_invariant=True, threads=spec.threads, quantize=spec.quantize, linear_kernel=spec.linear_kernel))


def decode_step_s(run: RunRecord) -> float:
    """The median wall time of the run's decode steps (prefill steps left out)."""
    return statistics.median(step.seconds for step in run.steps if step.is_decode)


def compare(dense_dir: Path, moe_dir: Path, spec: ComparisonSpec,
            progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    """One row per slot count: each side's decode step time per turn, the MoE / dense ratio
    per turn (the two runs of a turn back to back, on the same prompts) and the median ratio."""
    engines = {"dense": _engine(dense_dir, spec), "moe": _engine(moe_dir, spec)}
    vocab = engines["dense"].engine.vocab_size
    rows = []
    for slots in spec.slots:
        warm = synthetic_prompts(slots, spec.input_len, vocab, seed=10_000 + slots)
        for runner in engines.values():  # untimed: first-call costs and the caches warm
            runner.run(warm, [sampling_params("greedy", i, 8) for i in range(slots)], slots)
        load_avg = os.getloadavg()[0]  # other work on the machine as this slot count started
        step_s: dict[str, list[float]] = {side: [] for side in engines}
        for turn in range(spec.turns):
            prompts = synthetic_prompts(slots, spec.input_len, vocab, seed=turn)
            params = [sampling_params("greedy", i, spec.output_len) for i in range(slots)]
            for side, runner in engines.items():
                if progress:
                    progress(f"{slots} slots, turn {turn + 1}/{spec.turns}: {side}")
                step_s[side].append(decode_step_s(runner.run(prompts, params, slots)))
        ratios = [m / d for m, d in zip(step_s["moe"], step_s["dense"], strict=True)]
        rows.append({
            "slots": slots, "turns": spec.turns,
            "dense_step_ms_runs": " ".join(f"{1000 * s:.3f}" for s in step_s["dense"]),
            "moe_step_ms_runs": " ".join(f"{1000 * s:.3f}" for s in step_s["moe"]),
            "moe_over_dense_runs": " ".join(f"{r:.3f}" for r in ratios),
            "moe_over_dense_median": statistics.median(ratios),
            "dense_tokens_per_s_median": slots / statistics.median(step_s["dense"]),
            "moe_tokens_per_s_median": slots / statistics.median(step_s["moe"]),
            "load_avg_1m": load_avg,
        })
    first = engines["moe"].engine
    frame = pd.DataFrame(rows)
    return frame.assign(
        experts=spec.shape.experts, top_k=spec.shape.top_k, expert_width=spec.shape.expert_width(),
        dense_width=DENSE_SHAPE["intermediate_size"], dtype=spec.dtype, quantize=spec.quantize or "",
        weight_format=first.weight_format, input_len=spec.input_len, output_len=spec.output_len,
        moe_weight_mb=first.weights_nbytes / 1e6,
        dense_weight_mb=engines["dense"].engine.weights_nbytes / 1e6,
        dense_linear_kernel=engines["dense"].engine.kernel_choice.kernel.name,
        # every layer of a step in one native call (nanoserve.native.decoder), on each side
        dense_one_call_decoder=engines["dense"].engine.model.decoder is not None,
        moe_one_call_decoder=first.model.decoder is not None,
        native_experts=any(e is not None for e in first.model.native_experts),
        **describe_machine("cpu").columns(), **first.kernel_choice.columns())
