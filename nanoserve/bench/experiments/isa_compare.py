"""The engine's prefill and batched decode with the block tiles on each ISA this CPU runs, in
alternating turns in one process: the wide tiles (csrc/arch/x86/) against the AVX2 ones they
replace, on one model, with everything else (load, kernel choice, cache) shared.

Owns: the turns (every ISA once per turn, the order rotated every turn), the two figures of a
turn (a `--input-len` prompt prefilled alone, as tokens/s over its time to one token; `--slots`
requests of 32 tokens decoding `--output-len` tokens together, as generated tokens/s), each
ISA's median over turns and its ratio to AVX2's, and a CSV with the machine in every row.
Refuses: running without the native library, and options it does not know (exit 2 naming them).

    python -m nanoserve.bench.experiments.isa_compare --model PATH --input-len 512 --slots 16 --turns 3
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

from nanoserve import native
from nanoserve.bench.hardware import describe_machine
from nanoserve.bench.offline import synthetic_prompts
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

DECODE_PROMPT_LEN = 32


def turn(llm: LLM, args: argparse.Namespace) -> dict[str, float]:
    """One prefill and one batched decode, timed."""
    vocab = llm.engine.vocab_size
    prompt = synthetic_prompts(1, args.input_len, vocab, seed=time.monotonic_ns())[0]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    prefill_s = time.perf_counter() - start
    prompts = synthetic_prompts(args.slots, DECODE_PROMPT_LEN, vocab, seed=time.monotonic_ns())
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True))
    decode_s = time.perf_counter() - start
    return {"prefill_tok_s": args.input_len / prefill_s,
            "decode_tok_s": args.slots * args.output_len / decode_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.experiments.isa_compare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model path or GGUF file")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens prefilled alone")
    parser.add_argument("--slots", type=int, default=16, help="requests decoding together")
    parser.add_argument("--output-len", type=int, default=16, help="tokens each decoding request makes")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("results/isa_compare.csv"))
    args = parser.parse_args(argv)
    for name in ("input_len", "slots", "output_len", "turns", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    library = native.library()
    if library is None:
        sys.exit(native.status())
    isas = library.isas()[1:]
    llm = LLM(args.model, device="cpu", threads=args.threads, max_num_seqs=max(args.slots, 1),
              max_num_batched_tokens=max(args.input_len, 512))
    chosen = library.tiles_isa
    rows = []
    try:
        for number in range(1, args.turns + 1):
            order = isas[number % len(isas):] + isas[: number % len(isas)]
            for isa in order:
                native.choose_tiles_isa(isa)
                rows.append({"isa": isa, "turn": number, **turn(llm, args)})
                print(rows[-1], file=sys.stderr)
    finally:
        native.choose_tiles_isa(chosen)
    machine = describe_machine("cpu").columns()
    medians = []
    for isa in isas:
        mine = [r for r in rows if r["isa"] == isa]
        figures = {k: statistics.median(r[k] for r in mine) for k in ("prefill_tok_s", "decode_tok_s")}
        medians.append({"isa": isa, "turn": "median", **figures})
    base = next((m for m in medians if m["isa"] == "avx2"), medians[0])
    for median in medians:
        median["prefill_ratio_to_" + base["isa"]] = median["prefill_tok_s"] / base["prefill_tok_s"]
        median["decode_ratio_to_" + base["isa"]] = median["decode_tok_s"] / base["decode_tok_s"]
        print(", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in median.items()))
    settings = {"model": args.model, "input_len": args.input_len, "slots": args.slots,
                "output_len": args.output_len, "threads": args.threads, "load_avg_1m": os.getloadavg()[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = [machine | settings | r for r in rows + medians]
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for r in records for k in r)))
        writer.writeheader()
        writer.writerows(records)


if __name__ == "__main__":
    main()
