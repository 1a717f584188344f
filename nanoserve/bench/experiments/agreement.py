"""How far each dtype strays from a float32 reference: greedy tokens matched and logit error.

Owns: running the default model (or another) in each dtype on the reference cases of
shared/reference (prompt ids, greedy ids, last-position logits of an independent float32
implementation) and recording, per dtype and case, how many greedy tokens match before the
first divergence, whether all match, and the largest absolute error of the last-position
logits. `python -m nanoserve.bench.experiments.agreement --reference DIR --out
results/dtype_agreement.csv`; the dtype `quantized` is the default model in its own GGUF
quantization (Q4_1, Q8_0 head).
Refuses: judging; it measures, and README.md states what the figures mean for choosing a dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
from safetensors.torch import load_file

from nanoserve.bench.hardware import describe_machine
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams


def matched_prefix(ours: list[int], theirs: list[int]) -> int:
    """How many leading tokens agree."""
    count = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        count += 1
    return count


def measure(reference_dir: Path, dtypes: list[str], model: str | None = None) -> pd.DataFrame:
    cases = json.loads((reference_dir / "reference.json").read_text(encoding="utf-8"))["cases"]
    logits = load_file(reference_dir / "logits.safetensors")
    prompts = [case["prompt_ids"] for case in cases]
    rows = []
    for dtype in dtypes:
        llm = LLM(model, dtype=dtype, device="cpu", kv_cache_gb=0.25)
        ours = llm.prompt_logits(prompts)
        greedy = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0), progress=False)
        for i, (case, completion) in enumerate(zip(cases, greedy, strict=True)):
            expected = case["greedy_ids"]
            matched = matched_prefix(completion.token_ids, expected)
            rows.append({
                "dtype": dtype, "case": i, "reference_tokens": len(expected), "matched_tokens": matched,
                "all_matched": matched == len(expected) == len(completion.token_ids),
                "max_abs_logit_error": float((ours[i] - logits[f"last_logits_{i}"]).abs().max()),
                "top1_agrees": int(ours[i].argmax()) == int(logits[f"last_logits_{i}"].argmax()),
                "linear_kernel": llm.engine.kernel_choice.kernel.name,
                "weight_format": llm.engine.weight_format,
            })
    return pd.DataFrame(rows).assign(**describe_machine("cpu").columns())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="shared/reference/smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16,quantized")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("results/dtype_agreement.csv"))
    args = parser.parse_args(argv)
    frame = measure(args.reference, args.dtypes.split(","), args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False, float_format="%.6g")
    summary = frame.groupby("dtype").agg(cases=("case", "count"), all_matched=("all_matched", "sum"),
                                         tokens_matched=("matched_tokens", "sum"),
                                         tokens=("reference_tokens", "sum"),
                                         max_logit_error=("max_abs_logit_error", "max"),
                                         top1_agrees=("top1_agrees", "sum"))
    print(summary.to_string())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
