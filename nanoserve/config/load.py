"""What is loaded, where, and how it runs (`LoadConfig`): the checkpoint, its precision, the
device, and what the model is served for; and the values of `dtype` and `task`, which the
command line offers and the worker maps onto torch.

Refuses: loading anything (`nanoserve.loading`) and importing torch (the command line reads
these before any engine starts).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.errors import InvalidRequestError
from nanoserve.pooling_params import POOLING_METHODS

# LoadConfig.dtype's float precisions (worker/rank.py maps each name to torch's dtype of that name).
DTYPES = ("float32", "bfloat16", "float16")
# dtype "quantized": a GGUF's matrices run as the file's own blocks (float32 activations);
# "auto" picks it for a GGUF on a CPU with the native kernels, as llama.cpp runs GGUF files.
QUANTIZED = "quantized"
TASKS = ("generate", "embed")  # LoadConfig.task


@dataclass(frozen=True, slots=True)
class LoadConfig:
    model: str | None = None
    # auto: a GGUF in its own quantization on a CPU with native kernels, else float32 on CPU
    # and bfloat16 on CUDA; float32 / bfloat16 / float16; quantized (a GGUF's blocks).
    dtype: str = "auto"
    quantize: str | None = None  # q8_0 or q4_0: quantize a float checkpoint's matrices at load
    device: str | None = None  # None: cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's own context length
    # A request's tokens and logprobs do not depend on what shares its steps (DESIGN invariant 1).
    batch_invariant: bool = True
    linear_kernel: str | None = None  # None: the fastest that qualifies, measured at start-up
    threads: int | None = None  # CPU threads; None: every core this process may run on
    # "generate": the model generates and also pools embeddings (/v1/embeddings, LLM.embed);
    # "embed" (vLLM's --task embed): an embedding model, which pools only (generation refused).
    task: str = "generate"
    # How an embedding request pools the prompt's final hidden states ("last" or "mean");
    # None: the checkpoint's own choice (sentence-transformers' pooling config), else "last".
    pooling: str | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}",
                                      param="task")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_METHODS)}; "
                                      f"got {self.pooling!r}", param="pooling")
