"""The one Typer app every command registers on (`from cli.app import app`)."""

import typer

app = typer.Typer(
    name="nanoserve",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="nanoserve: a small LLM inference engine.",
)
