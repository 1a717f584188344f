"""A model's shape as a random-weight GGUF, and how near this machine's own limits the engine
runs it.

Owns: `ModelShape` (what a dense Llama-family GGUF needs; `PUBLISHED_SHAPES` names published
models' widths, which a check may cut to fewer layers: the kernels' cost per layer depends on the
width, not on how many layers there are), `write_model` (every matrix in one GGUF block type,
random blocks with sane scales from `nanoserve.quant.random_weight`, norms of ones, the default
model's tokenizer), and `limit_fractions`: a prompt's prefill and decode at one and at many
slots, each read against this machine's probes (the int8 peak of the ISA the block tiles run,
the streaming read rate), so that a figure does not move with the machine's speed; each is the
least disturbed of its turns, as each probe is its least disturbed trial.
Refuses: asserting a time (CI's gate compares the fractions with its floors) and timing a
shape the engine would run in another format than the one written (a figure of one format
read as another's).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from nanoserve.bench.driver import StepRecord, run_closed_loop
from nanoserve.bench.hardware import ComputePeak
from nanoserve.bench.offline import ModelCost, kv_blocks_for, synthetic_prompts
from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.engine.core import Engine
from nanoserve.quant import random_weight
from nanoserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int
    rms_eps: float
    rope_base: float

    @classmethod
    def of_default_model(cls, reader: GGUFReader) -> ModelShape:
        """The default model's shape, its widths rounded down to whole 256-value blocks."""
        def value(key: str) -> float:
            return reader.fields[key].contents()

        hidden, heads = int(value("llama.embedding_length")), int(value("llama.attention.head_count"))
        head_dim = hidden // heads
        rounded = hidden // 256 * 256
        return cls(layers=int(value("llama.block_count")), hidden=rounded, heads=rounded // head_dim,
                   kv_heads=max(1, int(value("llama.attention.head_count_kv")) * rounded // hidden),
                   intermediate=int(value("llama.feed_forward_length")) // 256 * 256,
                   vocab=len(reader.fields["tokenizer.ggml.tokens"].data),
                   context=int(value("llama.context_length")),
                   rms_eps=float(value("llama.attention.layer_norm_rms_epsilon")),
                   rope_base=float(value("llama.rope.freq_base")))

    def with_layers(self, layers: int) -> ModelShape:
        return dataclasses.replace(self, layers=layers)

    def matrices(self) -> dict[str, tuple[int, int]]:
        """GGUF tensor name -> (rows, columns) of every matrix, the token table first."""
        kv = self.hidden // self.heads * self.kv_heads
        hidden, intermediate = self.hidden, self.intermediate
        layer = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
                 "attn_output": (hidden, hidden), "ffn_gate": (intermediate, hidden),
                 "ffn_up": (intermediate, hidden), "ffn_down": (hidden, intermediate)}
        blocks = {f"blk.{i}.{name}.weight": shape
                  for i in range(self.layers) for name, shape in layer.items()}
        return {"token_embd.weight": (self.vocab, hidden), **blocks}


# config.json of each: the default model's tokenizer has the same 49152 ids
PUBLISHED_SHAPES = {
    "smollm2-1.7b": ModelShape(layers=24, hidden=2048, heads=32, kv_heads=32, intermediate=8192, vocab=49152,
                               context=8192, rms_eps=1e-5, rope_base=130000.0),
}


def write_model(path: Path, type_name: str, shape: ModelShape, tokenizer: GGUFReader) -> Path:
    """The model in `type_name` (every matrix; norms float32), written once and then reused."""
    if path.is_file():
        return path
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(str(partial), "llama")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_base)
    for field in tokenizer.fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    generator = torch.Generator().manual_seed(0)
    raw_dtype = GGMLQuantizationType[type_name.upper()]
    for name, (rows, cols) in shape.matrices().items():
        blocks = random_weight(type_name, rows, cols, generator=generator).blocks
        writer.add_tensor(name, blocks.numpy(), raw_dtype=raw_dtype)
    norms = [f"blk.{i}.{n}.weight" for i in range(shape.layers) for n in ("attn_norm", "ffn_norm")]
    for name in [*norms, "output_norm.weight"]:
        writer.add_tensor(name, torch.ones(shape.hidden).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


@dataclass(frozen=True, slots=True)
class LimitWorkload:
    prompt_len: int  # the prefill's one prompt, computed in one step
    slots: int  # requests decoding together in the batched run
    input_len: int  # each decode run's prompts
    output_len: int  # tokens each decode run's requests generate
    repeat: int  # turns, each a prefill, a 1-slot run and a `slots` run

    @property
    def max_len(self) -> int:
        return max(self.prompt_len + 1, self.input_len + self.output_len)


@dataclass(frozen=True, slots=True)
class BestTurns:
    """The least disturbed of the turns' figures."""

    prefill_s: float  # the prompt's prefill step
    single_step_s: float  # a decode step of one request
    batched_step_s: float  # a decode step of `slots` requests

    def summary(self, workload: LimitWorkload) -> str:
        w = workload
        return (f"prefill {w.prompt_len} tokens {w.prompt_len / self.prefill_s:.1f} tokens/s, 1 slot "
                f"{1 / self.single_step_s:.1f} tokens/s, {w.slots} slots {w.slots / self.batched_step_s:.1f} "
                f"tokens/s (best of {w.repeat} turns)")


def engine_for(path: Path, workload: LimitWorkload) -> Engine:
    """Every slot's blocks reserved and the prompt computed in one unpaced step: the prefill
    figure is the engine's GEMM over `prompt_len` rows, as llama.cpp's pp512 is."""
    return Engine(EngineConfig(
        model=str(path), dtype="auto", device="cpu", max_num_seqs=workload.slots,
        max_model_len=workload.max_len, num_kv_blocks=kv_blocks_for(workload.slots, workload.max_len),
        max_num_batched_tokens=max(workload.prompt_len, workload.slots * workload.input_len),
        prefill_step_ms=float("inf")))


def _steps(engine: Engine, count: int, input_len: int, max_tokens: int, seed: int) -> list[StepRecord]:
    prompts = synthetic_prompts(count, input_len, engine.model_config.vocab_size, seed=seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return run_closed_loop(engine, [(prompt, params) for prompt in prompts], count).steps


def _mean_decode_s(steps: list[StepRecord], rows: int) -> float:
    decodes = [step.seconds for step in steps if step.is_decode and step.rows == rows]
    return sum(decodes) / len(decodes)


def best_turns(engine: Engine, workload: LimitWorkload) -> BestTurns:
    """A warm-up of each run, then `repeat` turns of the prefill, one slot and `slots`."""
    w = workload
    for count, input_len, max_tokens in ((1, w.prompt_len, 1), (1, w.input_len, 2),
                                         (w.slots, w.input_len, 2)):
        _steps(engine, count, input_len, max_tokens, seed=0)
    prefill, single, batched = [], [], []
    for turn in range(1, w.repeat + 1):
        prefill.append(sum(s.seconds for s in _steps(engine, 1, w.prompt_len, 1, turn) if not s.is_decode))
        single.append(_mean_decode_s(_steps(engine, 1, w.input_len, w.output_len, turn), 1))
        batched.append(_mean_decode_s(_steps(engine, w.slots, w.input_len, w.output_len, turn), w.slots))
    return BestTurns(min(prefill), min(single), min(batched))


FRACTIONS = ("prefill_over_int8_peak", "batched_over_int8_peak", "single_over_read_roofline")


def limit_fractions(config: ModelConfig, weight_bytes: float, turns: BestTurns, workload: LimitWorkload,
                    peak: ComputePeak, read_gbs: float) -> dict[str, float]:
    """Each figure over the limit that bounds it: the linears' int8 operations (a multiply and an
    add per weight and row, the head for the prompt's last row only) a second over the probed
    int8 peak, and the weight bytes a 1-slot step streams a second over the probed read rate."""
    head_params = config.vocab_size * config.hidden_size
    prefill_ops = 2.0 * ((config.matmul_params - head_params) * workload.prompt_len + head_params)
    batched_ops = 2.0 * config.matmul_params * workload.slots
    peak_ops = peak.int8_gops * 1e9
    figures = (prefill_ops / turns.prefill_s / peak_ops, batched_ops / turns.batched_step_s / peak_ops,
               weight_bytes / turns.single_step_s / (read_gbs * 1e9))
    return dict(zip(FRACTIONS, figures, strict=True))


@dataclass(frozen=True, slots=True)
class ShapeReading:
    fractions: dict[str, float]  # limit_fractions'
    turns: BestTurns
    linear_kernel: str  # the kernel the engine chose at start-up


def measure(path: Path, type_name: str, workload: LimitWorkload, peak: ComputePeak,
            read_gbs: float) -> ShapeReading:
    """`path`'s model, written in `type_name`, read against this machine's probes."""
    engine = engine_for(path, workload)
    if engine.weight_format != type_name:
        raise RuntimeError(f"the {type_name} model runs as {engine.weight_format}: {engine.weight_notes}")
    turns = best_turns(engine, workload)
    weight_bytes = ModelCost.of_engine(engine).weight_bytes
    fractions = limit_fractions(engine.model_config, weight_bytes, turns, workload, peak, read_gbs)
    return ShapeReading(fractions, turns, engine.kernel_choice.kernel.name)
