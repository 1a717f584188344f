"""Decode step time of each GGUF weight type nanoserve runs in its own bytes, against Q4_K's.

Owns: a model of the default model's shape written to GGUF once per type (`shapes.write_model`:
random blocks with sane scales and the default GGUF's tokenizer), its hidden
width rounded down to whole 256-value blocks (SmolLM2-135M: 576 -> 512, 9 -> 8 heads of 64,
3 -> 2 KV heads; 30 layers, 1536 intermediate, the 49152-token table tied to the head) so that
Q4_K and the other K formats hold every matrix; the same decode workload through each type's
engine at each slot count, each type timed right beside its own Q4_K run (q4_k then a, b then
q4_k, ..., the order of a pair swapped each turn), so that a ratio's two sides share the
machine's state of those seconds, not of a turn that lasts a minute; and the CSV: each type's
median decode step, its ratio to Q4_K's (the median over turns of the paired ratios) beside the
goal (1.3), the bytes its packed weights hold (the layouts the kernel repacked them into) beside
the file's tensor bytes, and the machine.
Refuses: choosing anything or asserting a time (no test times anything).

    python -m nanoserve.bench.experiments.quant_types --slots 1,16 --repeat 3 --out results/quant_types.csv
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import pandas as pd
from gguf import GGUFReader

from nanoserve import native
from nanoserve.bench.driver import run_closed_loop
from nanoserve.bench.hardware import describe_machine
from nanoserve.bench.offline import kv_blocks_for, positive_int_list, synthetic_prompts
from nanoserve.bench.shapes import ModelShape, write_model
from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.loading.default_model import default_gguf_path
from nanoserve.machine import cache_root
from nanoserve.native.quant import MORE_FORMATS
from nanoserve.sampling_params import SamplingParams

REFERENCE_TYPE = "q4_k"
GOAL_RATIO = 1.3  # issue 32: each new type's decode step within 1.3x of Q4_K's
DEFAULT_TYPES = (REFERENCE_TYPE, *sorted(MORE_FORMATS))
INPUT_LEN, OUTPUT_LEN = 32, 64


def engine_for(path: Path, slots: tuple[int, ...], threads: int | None) -> Engine:
    max_len = INPUT_LEN + OUTPUT_LEN + 1
    return Engine(EngineConfig(model=str(path), dtype="auto", device="cpu", max_num_seqs=max(slots),
                               max_model_len=max_len, num_kv_blocks=kv_blocks_for(max(slots), max_len),
                               max_num_batched_tokens=max(512, INPUT_LEN * max(slots)), threads=threads))


def decode_step_ms(engine: Engine, slots: int, seed: int, output_len: int = OUTPUT_LEN) -> float:
    """Mean decode step of `slots` requests in flight (prompts of INPUT_LEN random ids, greedy)."""
    prompts = synthetic_prompts(slots, INPUT_LEN, engine.model_config.vocab_size, seed=seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    run = run_closed_loop(engine, [(p, params) for p in prompts], slots)
    decodes = [s.seconds for s in run.steps if s.is_decode]
    return 1000 * sum(decodes) / len(decodes)


def measure(types: tuple[str, ...], slots: tuple[int, ...], repeat: int, threads: int | None,
            directory: Path) -> pd.DataFrame:
    tokenizer = GGUFReader(default_gguf_path())
    shape = ModelShape.of_default_model(tokenizer)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {t: write_model(directory / f"smollm2-shape-{shape.hidden}-{t}.gguf", t, shape, tokenizer)
             for t in types}
    engines = {t: engine_for(path, slots, threads) for t, path in paths.items()}
    for t, engine in engines.items():
        if engine.weight_format != t:  # a figure of another format would be compared as this one
            raise RuntimeError(f"the {t} model runs as {engine.weight_format}: {engine.weight_notes}")
    machine = describe_machine("cpu")
    rows = []
    for count in slots:
        for engine in engines.values():  # warm: first calls, allocations
            decode_step_ms(engine, count, seed=0, output_len=4)
        load_avg = os.getloadavg()[0]
        runs: dict[str, list[float]] = {t: [] for t in types}
        ratios: dict[str, list[float]] = {t: [] for t in types}
        for turn in range(repeat):
            for t in types:
                pair = [REFERENCE_TYPE, t] if turn % 2 == 0 else [t, REFERENCE_TYPE]
                ms = {u: decode_step_ms(engines[u], count, seed=1 + turn) for u in pair}
                runs[t].append(ms[t])
                ratios[t].append(ms[t] / ms[REFERENCE_TYPE])
        for t, engine in engines.items():
            resident = engine.model.weights.nbytes()  # as packed for the chosen kernel
            file_bytes = sum(int(tensor.n_bytes) for tensor in GGUFReader(paths[t]).tensors)
            rows.append({
                "type": t, "slots": count, "decode_step_ms": statistics.median(runs[t]),
                "decode_step_ms_runs": " ".join(f"{ms:.3f}" for ms in runs[t]),
                f"ratio_to_{REFERENCE_TYPE}": statistics.median(ratios[t]),
                f"ratio_to_{REFERENCE_TYPE}_runs": " ".join(f"{r:.3f}" for r in ratios[t]),
                "goal_ratio": GOAL_RATIO,
                "linear_kernel": engine.kernel_choice.kernel.name, "weight_format": engine.weight_format,
                "resident_mb": resident / 1e6, "file_tensor_mb": file_bytes / 1e6,
                # every weight byte is read once a step: how near the memory bus each type runs
                "weights_read_gbs": resident / statistics.median(runs[t]) / 1e6,
                "resident_to_file": resident / file_bytes, "hidden": shape.hidden,
                "layers": shape.layers, "intermediate": shape.intermediate, "vocab": shape.vocab,
                "load_avg_1m": load_avg, **machine.columns()})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(DEFAULT_TYPES),
                        help=f"GGUF types to run, {REFERENCE_TYPE} among them (default: every new one)")
    parser.add_argument("--slots", type=positive_int_list, default="1,16",
                        help="requests in flight (default 1,16)")
    parser.add_argument("--repeat", type=int, default=3, help="timed turns per slot count (default 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch / kernel threads (default: all cores)")
    parser.add_argument("--out", type=Path, default=Path("results/quant_types.csv"))
    args = parser.parse_args(argv)
    types = tuple(t.strip().lower() for t in args.types.split(",") if t.strip())
    unknown = [t for t in types if t not in DEFAULT_TYPES]
    if unknown or REFERENCE_TYPE not in types:
        parser.error(f"--types: {unknown or 'no ' + REFERENCE_TYPE}; choose from {', '.join(DEFAULT_TYPES)}, "
                     f"{REFERENCE_TYPE} among them")
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1; got {args.repeat}")
    slots = args.slots
    if native.library() is None:  # every type would be dequantized to float32: no ratio to read
        parser.error(f"{native.status()}; this benchmark times the native kernels")
    frame = measure(types, slots, args.repeat, args.threads, cache_root() / "bench-quant-types")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False)
    columns = ["type", "slots", "decode_step_ms", f"ratio_to_{REFERENCE_TYPE}", "weights_read_gbs",
               "resident_to_file"]
    print(frame[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"{args.out}: {frame['cpu_model'].iloc[0]}, {frame['threads'].iloc[0]} threads")


if __name__ == "__main__":
    main()
