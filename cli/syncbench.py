"""`nanoserve syncbench`: the batched sampler against a per-row loop, on the model's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nanoserve_cli import options
from nanoserve_cli.app import app

PROMPT = "The capital of France is"


def _positive_ints(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(value < 1 for value in values):
        raise typer.BadParameter(f"expected comma-separated integers >= 1, got {text!r}",
                                 param_hint=option)
    return values


def _mixes(text: str) -> list[str]:
    from nanoserve.bench.syncbench import MIXES

    mixes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [mix for mix in mixes if mix not in MIXES]
    if not mixes or unknown:
        raise typer.BadParameter(f"expected some of {', '.join(MIXES)}, got {text!r}",
                                 param_hint="--mixes")
    return mixes


def _check_counts(repeat: int, warmup: int) -> None:
    if repeat < 1:
        raise typer.BadParameter(f"must be >= 1, got {repeat}", param_hint="--repeat")
    if warmup < 0:
        raise typer.BadParameter(f"must be >= 0, got {warmup}", param_hint="--warmup")


def model_logits_row(model: str | None, *, dtype: str = "auto", device: str | None = None,
                     threads: int | None = None):
    """The last-position logits of one prompt on `model` (the default model when None)."""
    from nanoserve import LLM

    return LLM(model=model, dtype=dtype, device=device, threads=threads).prompt_logits([PROMPT])[0]


@app.command()
def syncbench(
    model: Annotated[str | None, typer.Option(help="Model to take logits from (default model).")] = None,
    slots: Annotated[str, typer.Option(
        metavar="N,N,...", help="Rows per sampling step: requests decoding together, as bench's --slots.")]
        = "1,2,4,8,16,32",
    mixes: Annotated[str, typer.Option(help="Comma-separated sampling mixes.")] = "greedy,top_p,top_k,mixed",
    repeat: Annotated[int, typer.Option(help="Timed steps per rows x mix (the median is reported).")] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed steps first.")] = 3,
    dtype: Annotated[str, typer.Option(help=(
        "The dtype of the model the logits come from (auto, float32, bfloat16, ...); the sampler "
        "always sees float32 logits, as in the engine."))] = "auto",
    device: options.Device = None,
    threads: options.Threads = None,
    out_dir: Annotated[Path, typer.Option(help="Where the CSV and the PNG go.")] = Path("results"),
    out: Annotated[Path | None, typer.Option(
        help="The CSV's path (the PNG goes beside it); default: OUT_DIR/syncbench.csv.")] = None,
    rows: Annotated[str | None, typer.Option("--rows", hidden=True, help="Deprecated spelling of --slots.")]
        = None,
) -> None:
    """Time one sampling step: the batched sampler (one readback) against a per-row loop."""
    old_rows = None if rows is None else tuple(_positive_ints(rows, "--rows"))
    slots_list = options.slots_or_deprecated(tuple(_positive_ints(slots, "--slots")), old_rows, "--rows")
    mix_list = _mixes(mixes)
    _check_counts(repeat, warmup)
    options.EngineOptions(model=model, dtype=dtype, device=device, threads=threads).check()
    from nanoserve.bench.syncbench import noise_warning, run_syncbench, write_syncbench_outputs
    from nanoserve.errors import NanoserveError

    try:
        logits_row = model_logits_row(model, dtype=dtype, device=device, threads=threads)
    except NanoserveError as error:
        options.fail_for(error)
    frame = run_syncbench(logits_row, list(slots_list), mix_list, repeat, warmup,
                          logits_source=f"model {model or 'default'} ({dtype}), last position of {PROMPT!r}")
    csv_path, png_path = (write_syncbench_outputs(frame, out_dir) if out is None
                          else write_syncbench_outputs(frame, out.parent, out.stem))
    columns = ["rows", "mix", "engine_ms", "baseline_ms", "speedup", "engine_vs_greedy",
               "engine_readbacks_per_step", "baseline_readbacks_per_step", "engine_spread", "baseline_spread"]
    typer.echo(frame[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    warning = noise_warning(frame)
    if warning is not None:
        typer.secho(warning, err=True, fg=typer.colors.YELLOW)
    typer.echo(f"wrote {csv_path} and {png_path}")
