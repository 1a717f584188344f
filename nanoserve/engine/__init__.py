"""The request lifecycle on rank 0: admission (`admission`, which the server's front shares),
the step loop (`core`), scheduling and the fair share, the block pool and its prefix cache, a
step's tensors (`model_runner`), the batched sampler, drafting (`proposers`, `spec_decode`, the
draft model), outputs and stop rules. The scheduler and the block pool are plain Python over
integers; the ranks are started, stepped and stopped by the executor (`executor`), built by
`nanoserve.worker`."""
