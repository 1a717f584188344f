"""The `nanoserve` console script: the shared app with every command module registered."""

from nanoserve_cli import bench, bench_lora, bench_serve, generate, profile, serve, syncbench  # noqa: F401  (registers commands)
from nanoserve_cli.app import app

__all__ = ["app"]
