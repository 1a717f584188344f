"""Every linear kernel on the default model's own weights, side by side, against the read probe.

Owns: timing one forward's matrix multiplies (30 layers' qkv, o, gate_up and down, and the
head: every weight byte a decode step reads) through each kernel `nanoserve.model.linear` could
choose, at each row count and thread count, the kernels taken in turns within each repeat so
that a busy neighbour slows them alike; and the CSV of it, with the read-bandwidth probe of
the same minutes, the load average and the machine.
Refuses: choosing anything (the engine's `linear.choose_kernel` does that) and quoting one run:
every row is the median and the best of `--repeat` turns.

    python -m nanoserve.bench.experiments.linear_kernels --dtype float32,bfloat16 --rows 1,4,16,64 \
        --threads 1,2 --out results/linear_kernels.csv
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from nanoserve import native
from nanoserve.bench.hardware import describe_machine, read_bandwidth_gbs
from nanoserve.loading.default_model import resolve_model_dir
from nanoserve.loading.weights import load_weights
from nanoserve.model.linear import LinearKernel, kernels_for


def model_linears(dtype: torch.dtype) -> list[torch.Tensor]:
    _, weights = load_weights(resolve_model_dir(None), dtype=dtype, device=torch.device("cpu"))
    shape = weights.probe_shape()
    return [w for layer in shape.layers for w in layer] + [shape.head]


def packed_for(kernel: LinearKernel, weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    try:
        return [kernel.pack(w) for w in weights]
    except RuntimeError:  # this kernel has no path for the dtype here (oneDNN and bfloat16 on AVX2)
        return None


def forward_pass(kernel: LinearKernel, packed: list[torch.Tensor], rows: int, dtype: torch.dtype,
                 threads: int) -> Callable[[], None]:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in packed}

    def run() -> None:
        for weight in packed:
            kernel.apply(inputs[weight.shape[1]], weight, threads=threads)

    return run


def measure(dtype: torch.dtype, rows: list[int], threads: list[int], repeat: int,
            names: set[str] | None = None) -> list[dict]:
    weights = model_linears(dtype)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in weights)
    kernels = {k.name: (k, p) for k in kernels_for(torch.device("cpu"))
               if (names is None or k.name in names) and (p := packed_for(k, weights)) is not None}
    results = []
    for count in threads:
        torch.set_num_threads(count)
        probe_gbs = read_bandwidth_gbs()
        for m in rows:
            passes = {name: forward_pass(k, p, m, dtype, count) for name, (k, p) in kernels.items()}
            seconds: dict[str, list[float]] = {name: [] for name in passes}
            for run in passes.values():
                run()  # warm: allocation, oneDNN's primitive creation
            for _ in range(repeat):
                for name, run in passes.items():
                    start = time.perf_counter()
                    run()
                    seconds[name].append(time.perf_counter() - start)
            load = os.getloadavg()[0]
            for name, runs in seconds.items():
                best = min(runs)
                results.append({
                    "dtype": str(dtype).removeprefix("torch."), "threads": count, "rows": m, "kernel": name,
                    "ms_median": round(1e3 * statistics.median(runs), 2), "ms_best": round(1e3 * best, 2),
                    "weight_gbs_best": round(nbytes / best / 1e9, 2),
                    "read_probe_gbs": round(probe_gbs, 2),
                    "fraction_of_probe": round(nbytes / best / 1e9 / probe_gbs, 3),
                    "gflops_best": round(2 * m * params / best / 1e9, 1),
                    "weight_mb": round(nbytes / 1e6, 1), "load_avg_1m": load,
                })
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--threads", default=str(native.thread_count(None)))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--kernels", default=None, help="a subset of the kernels, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("results/linear_kernels.csv"))
    args = parser.parse_args(argv)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    try:
        chosen = [dtypes[name] for name in args.dtype.split(",")]
    except KeyError as error:
        parser.error(f"--dtype must be float32 and/or bfloat16; got {error.args[0]!r}")
    rows = [int(r) for r in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    machine = describe_machine().columns()
    names = set(args.kernels.split(",")) if args.kernels else None
    frame = pd.DataFrame([machine | row for dtype in chosen
                          for row in measure(dtype, rows, threads, args.repeat, names)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False)
    print(frame[["dtype", "threads", "rows", "kernel", "ms_median", "ms_best", "weight_gbs_best",
                 "fraction_of_probe", "load_avg_1m"]].to_string(index=False))


if __name__ == "__main__":
    main()
