"""The `nanoserve` console script: the shared app with every command module registered."""

import cli.bench_serve  # registers `bench serve`
import cli.serve  # noqa: F401
from cli import bench, generate, profile  # noqa: F401  (registers the commands)
from cli.app import app

__all__ = ["app"]
