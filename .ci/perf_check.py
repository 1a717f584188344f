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

from nanoserve.bench.offline import Sweep, SweepSpec, Workload, paired_ratio

THRESHOLDS_PATH = Path(__file__).with_name("perf_thresholds.json")


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
    args = parser.parse_args(argv)
    thresholds = load_thresholds(args.thresholds)
    floors: dict[str, float] = thresholds["floors"]
    if "over_transformers" in floors and not has_transformers():
        print("FAIL ci perf check: the transformers baseline is not installed (pip install -e '.[baseline]')")
        return 1
    start = time.perf_counter()
    spec = spec_from(thresholds, args.model, with_baseline="over_transformers" in floors)
    result = Sweep(spec).run()
    ratios = measured_ratios(result.frame, thresholds["workload"])
    checks = [Check(name, ratios[name], floor) for name, floor in floors.items()]
    print(f"machine: {result.machine.label}; commit {result.machine.git_commit}")
    for row in result.frame.itertuples():
        print(f"  {row.engine} {row.dtype} {row.slots} slots: {row.output_tokens_per_s:.1f} output tokens/s "
              f"(runs {row.tokens_per_s_runs})")
    for check in checks:
        print(check.line())
    passed = all(check.passed for check in checks)
    print(f"{'PASS' if passed else 'FAIL'} ci perf check ({time.perf_counter() - start:.0f} s, "
          f"floors from {args.thresholds.name})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
