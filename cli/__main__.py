"""`python -m nanoserve_cli`: the same app as the `nanoserve` console script."""

from nanoserve_cli.main import app

app()
