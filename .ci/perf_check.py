"""The CI performance check: ratios measured side by side in one run, against recorded floors.

`python .ci/perf_check.py` (the last line of `.ci/run`) runs a small offline bench on the
default model (slots 1 and 8, greedy, 32-token prompts, 32 new tokens, the median of a few
repeats) with Hugging Face transformers' `generate` beside it, and compares two ratios against
`perf_thresholds.json` beside it:
- batched_over_single: the engine's output tokens/s at 8 slots over its own at 1 slot;
- over_transformers: the engine's output tokens/s over transformers' at 8 slots;
- quantized_over_float32 (when the workload names a `quantized_dtype`): the default model in
  its own GGUF quantization over the same model dequantized to float32, at 1 slot, where the
  quantized kernels' advantage is widest (a slower integer kernel shows here first).
Its `shape` section runs a published 1B-class model's width (`nanoserve.bench.shapes`) at fewer
layers, written at run time from random blocks in each of its GGUF types, reads each figure
against this machine's own probes, named `{type}_{fraction}`, and compares it with the floor for
the ISA the block tiles ran (the section's `floors` by ISA):
- prefill_over_int8_peak: a prompt's prefill in one step (the GEMM over every prompt row), its
  linears' int8 operations a second over the probed int8 peak of the ISA the tiles run;
- batched_over_int8_peak: the same at a decode step of many slots;
- single_over_read_roofline: a 1-slot decode step's weight bytes a second over the probed
  streaming read rate (the memory-bound GEMV).
It prints one line per ratio and a final PASS or FAIL line; a FAIL exits 1. Absolute times are
never compared: a slower or busier machine moves both sides of each ratio together.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from gguf import GGUFReader

from nanoserve import native
from nanoserve.bench import shapes
from nanoserve.bench.hardware import compute_peak, describe_machine, read_bandwidth_gbs
from nanoserve.bench.offline import Sweep, SweepSpec, Workload, paired_ratio
from nanoserve.loading.default_model import default_gguf_path
from nanoserve.machine import cache_root

THRESHOLDS_PATH = Path(__file__).with_name("perf_thresholds.json")
# each probe keeps its least disturbed trial over this long: on a shared runner, a longer look
# finds the cores free more surely
PROBE_BUDGET_S = 2.0


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    measured: float
    floor: float

    @property
    def passed(self) -> bool:
        return self.measured >= self.floor

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return f"{verdict} {self.name}: {self.measured:.2f} (floor {self.floor:.2f})"


def load_thresholds(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def spec_from(thresholds: dict, model: str | None, *, with_baseline: bool) -> SweepSpec:
    w = thresholds["workload"]
    dtypes = (w["dtype"], w["quantized_dtype"]) if "quantized_dtype" in w else (w["dtype"],)
    return SweepSpec(
        slots=(1, w["slots"]), params=("greedy",), dtypes=dtypes, model=model, device="cpu",
        baseline="transformers" if with_baseline else None,
        workload=Workload(w["input_len"], w["output_len"], None, w["warmup"], w["repeat"]))


def measured_ratios(frame: pd.DataFrame, workload: dict) -> dict[str, float]:
    slots = workload["slots"]
    engine = frame[frame.engine == "nanoserve"]
    ours = engine[engine.dtype == workload["dtype"]].set_index("slots")
    ratios = {"batched_over_single": paired_ratio(ours.loc[slots], ours.loc[1])}
    if "transformers" in set(frame.engine):
        ratios["over_transformers"] = float(ours.ratio_to_baseline[slots])
    if "quantized_dtype" in workload:
        quantized = engine[engine.dtype == workload["quantized_dtype"]].set_index("slots")
        ratios["quantized_over_float32"] = paired_ratio(quantized.loc[1], ours.loc[1])
    return ratios


def default_model_ratios(thresholds: dict, model: str | None, floors: dict[str, float]) -> dict[str, float]:
    spec = spec_from(thresholds, model, with_baseline="over_transformers" in floors)
    result = Sweep(spec).run()
    for row in result.frame.itertuples():
        print(f"  {row.engine} {row.dtype} {row.slots} slots: {row.output_tokens_per_s:.1f} output tokens/s "
              f"(runs {row.tokens_per_s_runs})")
    return measured_ratios(result.frame, thresholds["workload"])


def shape_ratios(section: dict, directory: Path) -> tuple[dict[str, float], str]:
    """Each of the section's GGUF types at its shape, `{type}_{fraction}`, and the ISA the tiles
    ran; the files are written under `directory` once and reused."""
    start = time.perf_counter()
    shape = shapes.PUBLISHED_SHAPES[section["published"]].with_layers(section["layers"])
    workload = shapes.LimitWorkload(**section["workload"])
    peak, read_gbs = compute_peak(budget_s=PROBE_BUDGET_S), read_bandwidth_gbs("cpu", budget_s=PROBE_BUDGET_S)
    print(f"  probed: int8 peak {peak.int8_gops:.0f} GOPS ({peak.isa}, {peak.threads} threads), "
          f"read {read_gbs:.1f} GB/s")
    tokenizer = GGUFReader(default_gguf_path())
    directory.mkdir(parents=True, exist_ok=True)
    ratios = {}
    for type_name in section["types"]:
        name = f"{section['published']}-{shape.layers}-layers-{type_name}.gguf"
        path = shapes.write_model(directory / name, type_name, shape, tokenizer)
        reading = shapes.measure(path, type_name, workload, peak, read_gbs)
        print(f"  {type_name} {section['published']} at {shape.layers} layers ({reading.linear_kernel}): "
              f"{reading.turns.summary(workload)}")
        ratios |= {f"{type_name}_{fraction}": value for fraction, value in reading.fractions.items()}
    print(f"  shape checks: {time.perf_counter() - start:.0f} s")
    return ratios, peak.isa


def shape_floors(section: dict, isa: str) -> dict[str, float]:
    """The section's floors for the ISA the tiles ran (each ISA's tiles reach their own fraction
    of their own peak); an ISA with none of its own takes the lowest of each floor."""
    by_isa: dict[str, dict[str, float]] = section["floors"]
    if isa in by_isa:
        return by_isa[isa]
    names = next(iter(by_isa.values()))
    return {name: min(floors[name] for floors in by_isa.values()) for name in names}


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--thresholds", type=Path, default=THRESHOLDS_PATH)
    parser.add_argument("--model", default=None, help="model directory; default: the default model")
    parser.add_argument("--shape-dir", type=Path, default=cache_root() / "ci-shapes",
                        help="where the shape section's GGUF files are written once and reused")
    args = parser.parse_args(argv)
    thresholds = load_thresholds(args.thresholds)
    floors: dict[str, float] = dict(thresholds.get("floors", {}))
    if "over_transformers" in floors and not has_transformers():
        print("FAIL ci perf check: the transformers baseline is not installed (pip install -e '.[baseline]')")
        return 1
    if "shape" in thresholds and native.library() is None:
        print(f"FAIL ci perf check: the shape checks time the native kernels, and {native.status()}")
        return 1
    start = time.perf_counter()
    machine = describe_machine("cpu")
    print(f"machine: {machine.label}; commit {machine.git_commit}")
    ratios = default_model_ratios(thresholds, args.model, floors) if "workload" in thresholds else {}
    if "shape" in thresholds:
        measured, isa = shape_ratios(thresholds["shape"], args.shape_dir)
        ratios |= measured
        floors |= shape_floors(thresholds["shape"], isa)
    checks = [Check(name, ratios[name], floor) for name, floor in floors.items()]
    for check in checks:
        print(check.line())
    passed = all(check.passed for check in checks)
    print(f"{'PASS' if passed else 'FAIL'} ci perf check ({time.perf_counter() - start:.0f} s, "
          f"floors from {args.thresholds.name})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
