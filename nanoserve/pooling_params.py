"""What an embedding request asks of the engine: how its prompt's final hidden states become one
vector (vLLM's `PoolingParams`).

Owns: `PoolingParams`, checked on construction like `SamplingParams` (an `InvalidRequestError`
naming the field), and the pooling methods. A request pools the final hidden states (after the
model's last norm, as transformers' `last_hidden_state`) of its prompt: "last" takes the last
position's, "mean" averages every position's. Refuses: importing torch (the scheduler reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.errors import InvalidRequestError

POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    # None: the engine's method (`EngineConfig.pooling`, else the checkpoint's own, else "last").
    method: str | None = None
    normalize: bool = True  # scale the vector to unit L2 norm (OpenAI's embeddings are)
    # The vector's length; only the model's hidden size is served (no Matryoshka truncation),
    # checked by the engine once it knows the model. None: the hidden size.
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in POOLING_METHODS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_METHODS)}; "
                                      f"got {self.method!r}", param="pooling")
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false; got {self.normalize!r}",
                                      param="normalize")
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
            raise InvalidRequestError(f"dimensions must be an integer >= 1; got {dims!r}", param="dimensions")

    @property
    def reads_every_position(self) -> bool:
        """Mean pooling needs every prompt position's hidden state: none may come from the prefix cache."""
        return self.method == "mean"
