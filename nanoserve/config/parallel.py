"""How the model is split (`ParallelConfig`): tensor parallelism's rank count.

Refuses: starting or wiring the ranks (`nanoserve.distributed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    # Tensor parallelism (vLLM's --tensor-parallel-size): the model split over this many ranks,
    # one process each (nanoserve.distributed); 1: one process, exactly the code it always ran.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise InvalidRequestError(f"tensor_parallel_size must be an integer of at least 1; got "
                                      f"{self.tensor_parallel_size!r}", param="tensor_parallel_size")
