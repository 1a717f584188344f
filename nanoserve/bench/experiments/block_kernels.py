"""The block-format kernels side by side on a model's matrix shapes (the default model's, or
SmolLM2-1.7B's with `--shape 1.7b`): the file's row-major layout (csrc/gemm/matmul_quant.c,
matmul_more.c for Q5_0 / Q5_1 / IQ4_NL / IQ4_XS / Q2_K / Q3_K), the 8-column repacked layouts
(matmul_x8.c, matmul_kx8.c) on the widest ISA here (`x8`) and on each ISA this CPU runs
(`x8@avx2`, `x8@avx512vnni`, ...: csrc/runtime/isa.h), and the prefill GEMM (matmul_gemm.c: Q4_0,
Q4_1, Q8_0), per format and row count.

Owns: timing one call of each kernel on random blocks of each shape (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536; the K-quants only down), the kernels taken in turns and each
call's best of `--repeat` (the minimum: a busy neighbour only ever adds time), summed over the
shapes; and the CSV of
it with the machine, the load average and the ratios to the row-major kernel.
Refuses: choosing anything (model/linear.py measures and chooses at start-up) and running without
the native library.

    python -m nanoserve.bench.experiments.block_kernels --formats q4_1,q8_0,q4_k,q6_k --rows 1,16,64,512 \\
        --out results/block_kernels.csv
    python -m nanoserve.bench.block_kernels --shape 1.7b --formats q4_0,q4_k,q6_k --rows 1,16,512 \\
        --repeat 3 --out results/block_kernels_1.7b.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nanoserve import native, quant
from nanoserve.bench.hardware import describe_machine
from nanoserve.bench.offline import positive_int_list

# (out, in) of one layer's matrices: q, k and v stacked, o, gate and up stacked, down; per model.
SHAPES_BY_MODEL = {"135m": ((960, 576), (576, 576), (3072, 576), (576, 1536)),  # SmolLM2-135M
                   "1.7b": ((6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192))}  # SmolLM2-1.7B
SHAPES = SHAPES_BY_MODEL["135m"]
FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_xs")


def random_blocks(format_name: str, out_features: int, in_features: int, seed: int) -> quant.QuantizedWeight:
    """Random codes, and f16 scales of a trained model's size (every code pattern is a valid block)."""
    fmt = quant.FORMATS[format_name]
    generator = torch.Generator().manual_seed(seed)
    count = out_features * in_features // fmt.values
    blocks = torch.randint(0, 256, (count, fmt.bytes), dtype=torch.uint8, generator=generator)
    for offset in fmt.scale_offsets:
        scales = (torch.rand(count, 1, generator=generator) * 0.01).half()
        blocks[:, offset : offset + 2] = scales.view(torch.uint8)
    return quant.QuantizedWeight(fmt, (out_features, in_features), blocks.reshape(out_features, -1))


def shapes_for(format_name: str, shapes: tuple[tuple[int, int], ...] = SHAPES) -> list[tuple[int, int]]:
    """The shapes a format can hold: at 135M the K-quants' 256-value blocks fit only down's 1536
    inputs (llama-quantize writes the others of that model in a 32-value fallback format)."""
    return [(n, k) for n, k in shapes if k % quant.FORMATS[format_name].values == 0]


def kernels_for(format_name: str) -> dict[str, tuple[Callable, Callable]]:
    """Name -> (pack, multiply) of every kernel that runs this format."""
    from nanoserve.native import quant as row_major
    from nanoserve.native import repack

    kernels = {"row-major": (lambda w: w, row_major.matmul)}
    k_layout = repack.k_repackable(random_blocks(format_name, 8, 256, 0))
    pack, multiply = (repack.repack_k, repack.matmul_k) if k_layout else (repack.repack, repack.matmul)
    kernels["x8"] = (pack, multiply)
    for isa in native.library().isas()[1:]:  # each vector ISA this CPU runs
        kernels[f"x8@{isa}"] = (pack, lambda x, w, isa=isa, multiply=multiply: multiply(x, w, isa=isa))
    if k_layout:
        return kernels
    if repack.has_gemm(repack.repack(random_blocks(format_name, 8, 32, 0))):
        kernels["gemm"] = (repack.repack, repack.gemm)
    return kernels


def seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(format_name: str, rows: int, repeat: int,
            shapes: tuple[tuple[int, int], ...] = SHAPES) -> dict[str, float]:
    """Milliseconds of one call per shape, summed over the format's shapes, per kernel; kernels in turns."""
    kernels = kernels_for(format_name)
    total = dict.fromkeys(kernels, 0.0)
    for index, (out_features, in_features) in enumerate(shapes_for(format_name, shapes)):
        weight = random_blocks(format_name, out_features, in_features, seed=index)
        packed = {name: pack(weight) for name, (pack, _) in kernels.items()}
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(index))
        best = dict.fromkeys(kernels, float("inf"))
        for _ in range(repeat):  # every kernel once per turn, so a neighbour's burst hits them alike
            for name, (_, multiply) in kernels.items():
                best[name] = min(best[name], seconds(lambda m=multiply, p=packed[name], x=x: m(x, p)))
        for name in kernels:
            total[name] += 1000 * best[name]
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.experiments.block_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="q4_1,q8_0,q4_k,q6_k", help=",".join(FORMATS))
    parser.add_argument("--rows", type=positive_int_list, default="1,16,64,512",
                        help="rows per call, comma-separated")
    parser.add_argument("--repeat", type=int, default=50, help="turns per shape; each call's best is kept")
    parser.add_argument("--shape", choices=sorted(SHAPES_BY_MODEL), default="135m",
                        help="whose matrix shapes: SmolLM2-135M's or SmolLM2-1.7B's")
    parser.add_argument("--out", type=Path, default=Path("results/block_kernels.csv"))
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    if unknown := [f for f in formats if f not in FORMATS]:
        parser.error(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    rows = args.rows
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1; got {args.repeat}")
    if native.library() is None:
        sys.exit(native.status())
    machine = describe_machine("cpu").columns()
    records = []
    for format_name in formats:
        for count in rows:
            load = os.getloadavg()[0]
            ms = measure(format_name, count, args.repeat, SHAPES_BY_MODEL[args.shape])
            shapes = " ".join(f"{n}x{k}" for n, k in shapes_for(format_name, SHAPES_BY_MODEL[args.shape]))
            record = {**machine, "format": format_name, "shapes": shapes, "rows": count,
                      "repeat": args.repeat, "load_avg_1m": round(load, 2)}
            record |= {f"{name}_ms": round(value, 4) for name, value in ms.items()}
            record |= {f"{name}_speedup_vs_row_major": round(ms["row-major"] / value, 3)
                       for name, value in ms.items() if name != "row-major"}
            if "gemm" in ms:
                record["gemm_speedup_vs_x8"] = round(ms["x8"] / ms["gemm"], 3)
            if "x8@avx2" in ms:  # the widest ISA's tiles against the AVX2 ones they replace
                record["x8_speedup_vs_avx2"] = round(ms["x8@avx2"] / ms["x8"], 3)
            records.append(record)
            print(", ".join(f"{k}={v}" for k, v in record.items() if k not in machine), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(column for record in records for column in record))
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)


if __name__ == "__main__":
    main()
