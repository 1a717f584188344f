"""`nanoserve bench lora`: requests spread over LoRA adapters against the same requests with
none, output tokens/s side by side (alternating turns, median ratio); `nanoserve.bench.lora`
measures, this writes the CSV and a line per turn."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nanoserve_cli import options
from nanoserve_cli.bench import bench_app

if TYPE_CHECKING:
    from nanoserve.bench.lora import TurnResult

DEFAULT_OUT = Path("results/bench_lora.csv")


@bench_app.command("lora")
def bench_lora(
    model: options.Model = None,
    dtype: Annotated[str, typer.Option(help="The model's dtype, as --dtype everywhere.")] = "auto",
    adapters: Annotated[int, typer.Option(min=1, help="LoRA adapters the requests are spread over.")] = 4,
    requests: Annotated[int, typer.Option(min=1, help="Concurrent requests (request i: adapter i mod N).")]
    = 16,
    rank: Annotated[int, typer.Option(min=1, help="Each adapter's rank (every target module).")] = 16,
    input_len: Annotated[int, typer.Option(min=1, help="Prompt tokens per request.")] = 64,
    output_len: Annotated[int, typer.Option(min=1, help="Output tokens per request.")] = 64,
    turns: Annotated[int, typer.Option(min=1, help="Turns of (base, LoRA) in alternating order.")] = 3,
    threads: options.Threads = None,
    linear_kernel: options.LinearKernel = None,
    out: Annotated[Path, typer.Option(help="CSV to write (one row per turn).")] = DEFAULT_OUT,
) -> None:
    """Output tokens/s of requests on LoRA adapters against the same requests without."""
    import pandas as pd

    from nanoserve.bench.lora import LoRABenchSpec, median_ratio, run_lora_bench
    from nanoserve.errors import NanoserveError

    options.check_linear_kernel(linear_kernel)
    spec = LoRABenchSpec(model, dtype, adapters, requests, rank, input_len, output_len, turns, threads,
                         linear_kernel)
    try:
        with tempfile.TemporaryDirectory(prefix="nanoserve-lora-bench-") as adapter_root:
            results, setup = run_lora_bench(spec, Path(adapter_root), on_turn=_echo)
    except NanoserveError as error:
        options.fail_for(error)
    rows = [{"turn": t.turn, "first": t.first, "base_tokens_per_s": round(t.base_tokens_per_s, 4),
             "lora_tokens_per_s": round(t.lora_tokens_per_s, 4), "ratio": round(t.ratio, 4),
             "load_avg_1m": round(t.load_avg_1m, 2),
             "median_ratio": round(median_ratio(results), 4), **setup} for t in results]
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out, index=False)
    typer.echo(f"median ratio {median_ratio(results):.3f} ({setup['cpu_model']}); wrote {out}")


def _echo(turn: TurnResult) -> None:
    typer.echo(f"turn {turn.turn} ({turn.first} first): base {turn.base_tokens_per_s:.1f} tok/s, "
               f"LoRA {turn.lora_tokens_per_s:.1f} tok/s, ratio {turn.ratio:.3f} "
               f"(load average {turn.load_avg_1m:.1f})")
