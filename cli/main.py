"""The `nanoserve` console script: the shared app with every command module registered."""

from cli import generate  # noqa: F401  (registers the command)
from cli.app import app

__all__ = ["app"]
