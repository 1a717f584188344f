"""`nanoserve syncbench`: the batched sampler against a per-row loop, on the model's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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


def model_logits_row(model: str | None):
    """The last-position logits of one prompt on `model` (the default model when None)."""
    from nanoserve import LLM

    return LLM(model=model).prompt_logits([PROMPT])[0]


@app.command()
def syncbench(
    model: Annotated[str | None, typer.Option(help="Model to take logits from (default model).")] = None,
    rows: Annotated[str, typer.Option(help="Comma-separated rows per step.")] = "1,2,4,8,16,32",
    mixes: Annotated[str, typer.Option(help="Comma-separated sampling mixes.")] = "greedy,top_p,top_k,mixed",
    repeat: Annotated[int, typer.Option(help="Timed steps per rows x mix (the median is reported).")] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed steps first.")] = 3,
    out_dir: Annotated[Path, typer.Option(help="Where the CSV and the PNG go.")] = Path("results"),
    out: Annotated[Path | None, typer.Option(
        help="The CSV's path (the PNG goes beside it); default: OUT_DIR/syncbench.csv.")] = None,
) -> None:
    """Time one sampling step: the batched sampler (one readback) against a per-row loop."""
    rows_list, mix_list = _positive_ints(rows, "--rows"), _mixes(mixes)
    _check_counts(repeat, warmup)
    from nanoserve.bench.syncbench import run_syncbench, write_syncbench_outputs

    frame = run_syncbench(model_logits_row(model), rows_list, mix_list, repeat, warmup,
                          logits_source=f"model {model or 'default'}, last position of {PROMPT!r}")
    csv_path, png_path = (write_syncbench_outputs(frame, out_dir) if out is None
                          else write_syncbench_outputs(frame, out.parent, out.stem))
    columns = ["rows", "mix", "engine_ms", "baseline_ms", "speedup", "engine_vs_greedy",
               "engine_readbacks_per_step", "baseline_readbacks_per_step"]
    typer.echo(frame[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    typer.echo(f"wrote {csv_path} and {png_path}")
