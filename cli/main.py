"""The `nanoserve` console script: the shared app with every command module registered."""

from nanoserve_cli import (  # noqa: F401  (registers commands)
    bench,
    bench_lora,
    bench_moe,
    bench_serve,
    generate,
    profile,
    serve,
    syncbench,
)
from nanoserve_cli.app import app

__all__ = ["app"]
