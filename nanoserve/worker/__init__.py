"""One rank: rank 0's start-up policy that every rank reads (`startup`), a rank built to rank 0's
plan (`rank`), and a tensor-parallel worker's loop (`loop`; `python -m nanoserve.worker.loop`
is a local worker's process, started by `nanoserve.engine.executor`)."""
