"""The one Typer app every command registers on (`from nanoserve_cli.app import app`)."""

import typer

app = typer.Typer(
    name="nanoserve",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    help="nanoserve: a small LLM inference engine.",
)
