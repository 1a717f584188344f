"""Tensor parallelism: pure shard arithmetic (what rank r of N holds, imported by the
loaders), and the process groups, collectives and worker loop that run ranks."""
