"""What is loaded and in what precision: the values of `EngineConfig.dtype` and `task`, which
the command line offers and the worker maps onto torch.

Refuses: loading anything (`nanoserve.loading`) and importing torch (the command line reads
these before any engine starts).
"""

# --dtype's float precisions (worker/rank.py maps each name to torch's dtype of that name).
DTYPES = ("float32", "bfloat16", "float16")
# --dtype quantized: a GGUF's matrices run as the file's own blocks (float32 activations);
# "auto" picks it for a GGUF on a CPU with the native kernels, as llama.cpp runs GGUF files.
QUANTIZED = "quantized"
TASKS = ("generate", "embed")  # EngineConfig.task
