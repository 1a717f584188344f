"""One rank: its weights, linear kernel, model and KV cache, built the same way on rank 0 and on
every tensor-parallel worker (`rank`); `python -m nanoserve.worker` is a local worker's process."""
