"""`nanoserve bench`: the offline throughput sweep (the callback) and its subcommands."""

from __future__ import annotations

import typer

from cli.app import app

bench_app = typer.Typer(
    invoke_without_command=True,
    no_args_is_help=False,
    help="Measure the engine: the offline sweep (no subcommand) or `bench serve`.",
)
app.add_typer(bench_app, name="bench")


@bench_app.callback()
def bench(ctx: typer.Context) -> None:
    """Run the offline bench when no subcommand is given."""
    if ctx.invoked_subcommand is not None:
        return
    typer.echo("nanoserve bench: the offline sweep is being written; see `bench --help`.")
