"""A sparse layer's routed experts in a published GGUF's layouts: the per-expert Python loop
(model/moe.py, the only way such experts ran before csrc/stages/moe.c took every layout) against the one
native call (nanoserve.native.moe; the one-call decoder runs the same stage), per layout mix and
row count.

Owns: one random sparse layer per layout mix (a Q4_K_M file's experts: Q4_K gate/up, Q6_K down;
an IQ4_XS file's; Q8_0 and Q4_0 for the layouts the call took before; F16), packed as the
`native-quant-x8` kernel packs it, the same rows routed both ways; the two taken in turns, each
one's best of `--repeat` (a busy neighbour only ever adds time); and the CSV of it with the
machine and the load average.
Refuses: running without the native library; a layout mix a width cannot hold (K types and
IQ4_XS need whole 256-value blocks).

Default shape: Mixtral-8x7B's sparse layer at a quarter of its width (8 experts, top-2, hidden
1024, each expert 3584 wide). Qwen3-30B-A3B's own: `--experts 128 --top-k 8 --hidden 2048
--width 768`.

    python -m nanoserve.bench.experiments.moe_layouts --mixes q4_k_m,iq4_xs,q4_0 --rows 1,16 \\
        --out results/moe_layouts.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import torch

from nanoserve import native, quant
from nanoserve.bench.hardware import describe_machine
from nanoserve.bench.offline import positive_int_list
from nanoserve.config import Experts

# A mix's GGUF types: (gate and up, down), as the files' experts hold them.
MIXES = {"q4_k_m": ("q4_k", "q6_k"), "iq4_xs": ("iq4_xs", "iq4_xs"), "q8_0": ("q8_0", "q8_0"),
         "q4_0": ("q4_0", "q4_0"), "f16": ("f16", "f16")}


def sparse_layer(mix: str, experts: int, top_k: int, hidden: int, width: int):
    """(block, packed weights, native experts) of one random layer in `mix`."""
    from nanoserve.model.linear import QUANTIZED_KERNELS
    from nanoserve.model.moe import MixtureOfExperts
    from nanoserve.model.weights import MoEWeights
    from nanoserve.native import ops
    from nanoserve.native.moe import NativeExperts

    gate_up_format, down_format = MIXES[mix]
    generator = torch.Generator().manual_seed(0)

    def blocks(format_name: str, rows: int, columns: int) -> quant.QuantizedWeight:
        return quant.random_weight(format_name, rows, columns, generator=generator)

    weights = MoEWeights(torch.randn(experts, hidden, generator=generator),
                         [blocks(gate_up_format, 2 * width, hidden) for _ in range(experts)],
                         [blocks(down_format, hidden, width) for _ in range(experts)], top_k)
    kernel = QUANTIZED_KERNELS["native-quant-x8"]
    packed = weights.with_matrices(kernel.pack, lambda m: m)
    spec = Experts(experts, top_k, width, renormalize=True, sparse_layers=(True,))
    block = MixtureOfExperts(spec, kernel.apply, ops.load().silu_mul)
    call = NativeExperts.for_layer(packed.router, packed.gate_up, packed.down, top_k, renormalize=True,
                                   float_panels=False)
    if call is None:
        raise RuntimeError(f"the native experts refused the {mix} layer")
    return block, packed, call


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(mix: str, rows: int, repeat: int, shape: tuple[int, int, int, int]) -> dict[str, float]:
    """Milliseconds of one layer's experts over `rows` rows, loop and one call, best of `repeat` turns."""
    block, packed, call = sparse_layer(mix, *shape)
    x = torch.randn(rows, shape[2], generator=torch.Generator().manual_seed(rows))
    ways = {"loop": lambda: block(x, packed), "one_call": lambda: block(x, packed, call)}
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeat):  # both ways once per turn, so a neighbour's burst hits them alike
        for name, run in ways.items():
            best[name] = min(best[name], seconds(run))
    return {name: 1000 * value for name, value in best.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.experiments.moe_layouts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixes", default="q4_k_m,iq4_xs,q4_0", help=",".join(MIXES))
    parser.add_argument("--rows", type=positive_int_list, default="1,16",
                        help="rows per call, comma-separated")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--width", type=int, default=3584, help="each expert's intermediate width")
    parser.add_argument("--repeat", type=int, default=20, help="turns; each way's best is kept")
    parser.add_argument("--out", type=Path, default=Path("results/moe_layouts.csv"))
    args = parser.parse_args(argv)
    mixes = args.mixes.split(",")
    if unknown := [m for m in mixes if m not in MIXES]:
        parser.error(f"--mixes: unknown {', '.join(unknown)}; choose from {', '.join(MIXES)}")
    rows = args.rows
    experts, top_k, hidden, width, repeat = args.experts, args.top_k, args.hidden, args.width, args.repeat
    sizes = {"--experts": experts, "--top-k": top_k, "--hidden": hidden, "--width": width, "--repeat": repeat}
    if small := [option for option, value in sizes.items() if value < 1]:
        parser.error(f"{', '.join(small)}: must be >= 1")
    if top_k > experts:
        parser.error(f"--top-k {top_k} exceeds --experts {experts}")
    for mix in mixes:
        for format_name, k in zip(MIXES[mix], (hidden, width), strict=True):
            if k % quant.FORMATS[format_name].values:
                parser.error(f"--mixes {mix}: {format_name} needs --hidden and --width in whole "
                             f"{quant.FORMATS[format_name].values}-value blocks")
    if native.library() is None:
        sys.exit(native.status())
    machine = describe_machine("cpu").columns()
    records = []
    for mix in mixes:
        for count in rows:
            load = os.getloadavg()[0]
            ms = measure(mix, count, repeat, (experts, top_k, hidden, width))
            record = {**machine, "mix": mix, "gate_up": MIXES[mix][0], "down": MIXES[mix][1],
                      "experts": experts, "top_k": top_k, "hidden": hidden, "width": width, "rows": count,
                      "repeat": repeat, "load_avg_1m": round(load, 2), "loop_ms": round(ms["loop"], 4),
                      "one_call_ms": round(ms["one_call"], 4),
                      "one_call_speedup": round(ms["loop"] / ms["one_call"], 3)}
            records.append(record)
            print(", ".join(f"{k}={v}" for k, v in record.items() if k not in machine), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


if __name__ == "__main__":
    main()
