"""`nanoserve bench moe`: a mixture of experts against the dense model of the same active size.

Writes the pair of random-weight checkpoints once (under the cache, or `--models-dir`), times
their decode in alternating turns at each slot count, prints the table and writes the CSV;
`nanoserve.bench.moe_vs_dense` does the measuring.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from nanoserve_cli import options
from nanoserve_cli.app import app  # noqa: F401  (bench_app hangs off it)
from nanoserve_cli.bench import bench_app, checked

DEFAULT_OUT = Path("results/moe_vs_dense.csv")
SHOWN = ("slots", "dense_step_ms_runs", "moe_step_ms_runs", "moe_over_dense_runs", "moe_over_dense_median")


def _slots(text: str) -> tuple[int, ...]:
    from nanoserve.bench.offline import parse_int_list

    return parse_int_list(text, minimum=1)


@bench_app.command("moe")
def bench_moe(
    slots: Annotated[str, typer.Option(callback=checked(_slots), metavar="N,N,...",
                                       help="Requests decoding together.")] = "1,16",
    turns: Annotated[int, typer.Option(
        min=1, help="Alternating turns per slot count (the ratio's median).")] = 3,
    experts: Annotated[int, typer.Option(min=2, help="Experts per sparse layer.")] = 8,
    top_k: Annotated[int, typer.Option(
        min=1, help="Experts a row runs; each is the dense width / top-k.")] = 2,
    input_len: Annotated[int, typer.Option(min=1, help="Prompt length in tokens.")] = 32,
    output_len: Annotated[int, typer.Option(min=2, help="Tokens generated per request.")] = 64,
    quantize: Annotated[str | None, typer.Option(
        help="q8_0 or q4_0: both models' matrices in GGUF blocks at load (the router stays float).")] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads (default: torch's).")] = None,
    linear_kernel: options.LinearKernel = None,
    models_dir: Annotated[Path | None, typer.Option(
        help="Where the two checkpoints are written (default: the nanoserve cache).")] = None,
    out: Annotated[Path, typer.Option(help="CSV to write.")] = DEFAULT_OUT,
) -> None:
    """Decode step time of a Mixtral-style MoE shaped like SmolLM2-135M (top-k experts as wide as
    the dense MLP together) over the dense model, turn by turn; the goal is a median within 1.3x."""
    from rich.console import Console
    from rich.table import Table

    from nanoserve.bench.moe_vs_dense import ComparisonSpec, MoEShape, compare, write_pair
    from nanoserve.errors import NanoserveError
    from nanoserve.loading.default_model import resolve_model
    from nanoserve.machine import cache_root
    from nanoserve.quant import QUANTIZERS

    if quantize is not None and quantize not in QUANTIZERS:
        options.fail(f"--quantize must be one of {', '.join(QUANTIZERS)}; got {quantize!r}")
    options.check_linear_kernel(linear_kernel)
    if experts < top_k:
        options.fail(f"--top-k {top_k} is more than the {experts} --experts")
    shape = MoEShape(experts, top_k)
    try:
        shape.expert_width()
    except ValueError as error:
        options.fail(f"--top-k: {error}")
    console = Console(stderr=True)
    spec = ComparisonSpec(slots=slots, turns=turns, input_len=input_len, output_len=output_len,
                          quantize=quantize, threads=threads, linear_kernel=linear_kernel, shape=shape)
    try:
        with console.status("writing the checkpoints (once)"):
            tokenizer_dir = resolve_model(None, float_weights=False).dir
            dense_dir, moe_dir = write_pair(models_dir or cache_root() / "bench-moe", shape, tokenizer_dir)
        with console.status("loading") as status:
            frame = compare(dense_dir, moe_dir, spec, progress=status.update)
    except NanoserveError as error:
        options.fail(str(error))
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out, index=False, float_format="%.6g")
    table = Table(title=f"MoE / dense decode step, {frame['cpu_model'][0]}, {frame['threads'][0]} threads")
    for column in SHOWN:
        table.add_column(column)
    for row in frame[list(SHOWN)].itertuples(index=False):
        table.add_row(*(f"{value:.3f}" if isinstance(value, float) else str(value) for value in row))
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    console.print(f"wrote {out}")
