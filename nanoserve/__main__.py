"""`python -m nanoserve`: the same app as the `nanoserve` console script."""

from nanoserve_cli.main import app

app(prog_name="nanoserve")
