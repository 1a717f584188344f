"""`python -m cli`: the same app as the `nanoserve` console script."""

from cli.main import app

app()
