"""Huge pages under the weights (nanoserve/huge_pages.py) against the allocator's small pages,
in alternating turns: one engine process each way a turn (NANOSERVE_HUGE_PAGES=0 for the small
pages), the order rotated every turn.

Each process: its first request, a `--first-prompt-len` prompt prefilled alone (tokens/s, and
the process's resident memory after it: what a server's first user waits for, page faults of
the KV cache's first writes included); one-slot decode after a `--input-len` prompt, as
(tokens - 1) / (time to all tokens - time to the first); and the output head's matrix-vector
product alone (the largest matrix a step reads), as its bytes / median time, on the pages the
engine gave it.

    python -m nanoserve.bench.experiments.huge_pages --model PATH --turns 3 --out results/huge_pages.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nanoserve.bench.experiments.memory import resident_bytes
from nanoserve.bench.hardware import describe_machine

MODES = {"huge": "1", "small": "0"}


def measure(model: str, first_prompt_len: int, input_len: int, output_len: int) -> dict[str, float]:
    """One engine's figures (run in the child process)."""
    import torch

    from nanoserve.bench.offline import synthetic_prompts
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    llm = LLM(model, device="cpu", prefill_step_ms=float("inf"))  # the first prompt in one step
    engine = llm.engine
    first = synthetic_prompts(1, first_prompt_len, engine.vocab_size, seed=time.monotonic_ns())[0]
    start = time.perf_counter()
    llm.generate([first], SamplingParams(max_tokens=1, temperature=0.0))
    first_prefill_tok_s = first_prompt_len / (time.perf_counter() - start)
    resident_gb = resident_bytes() / 1e9
    prompt = synthetic_prompts(1, input_len, engine.vocab_size, seed=time.monotonic_ns())[0]

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    timed(4)  # the kernels' first calls, off the clock
    decode = [(output_len - 1) / (timed(output_len) - timed(1)) for _ in range(3)]
    model_ = engine.model
    head, x = model_.weights.lm_head, torch.randn(1, model_.config.hidden_size)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        model_.linear(x, head)
        times.append(time.perf_counter() - start)
    return {"first_prefill_tok_s": first_prefill_tok_s, "resident_gb_after_first": resident_gb,
            "decode_tok_s": statistics.median(decode),
            "head_gemv_gb_s": head.nbytes / statistics.median(times) / 1e9, "head_mb": head.nbytes / 1e6}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.experiments.huge_pages",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model path or GGUF file")
    parser.add_argument("--first-prompt-len", type=int, default=512, help="the first request's prompt")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/huge_pages.csv"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("first_prompt_len", "input_len", "output_len", "turns"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (decode is timed after the first token)")
    if args.child:
        print(json.dumps(measure(args.model, args.first_prompt_len, args.input_len, args.output_len)))
        return
    machine = describe_machine().columns()
    rows = []
    for turn in range(1, args.turns + 1):
        order = list(MODES) if turn % 2 else list(reversed(MODES))
        for mode in order:
            command = [sys.executable, "-m", "nanoserve.bench.experiments.huge_pages", "--child", "--model",
                       args.model, "--first-prompt-len", str(args.first_prompt_len), "--input-len",
                       str(args.input_len), "--output-len", str(args.output_len)]
            env = {**os.environ, "NANOSERVE_HUGE_PAGES": MODES[mode]}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"the {mode}-pages engine failed:\n{done.stderr[-2000:]}")
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({**machine, "model": Path(args.model).name, "turn": turn, "pages": mode,
                         **{k: round(v, 3) for k, v in figures.items()},
                         "load_avg_1m": round(os.getloadavg()[0], 2)})
            print(f"turn {turn} {mode:>5} pages: first prompt {figures['first_prefill_tok_s']:.1f} tokens/s "
                  f"({figures['resident_gb_after_first']:.2f} GB resident), decode "
                  f"{figures['decode_tok_s']:.1f} tokens/s, head {figures['head_gemv_gb_s']:.1f} GB/s",
                  flush=True)
    for figure in ("first_prefill_tok_s", "decode_tok_s", "head_gemv_gb_s"):
        ratios = [on[figure] / off[figure] for on, off in zip(rows[0::2], rows[1::2], strict=True)
                  for on, off in [(on, off) if on["pages"] == "huge" else (off, on)]]
        print(f"{figure}: huge / small pages each turn {', '.join(f'{r:.3f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
