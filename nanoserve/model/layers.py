"""The small per-row ops of a decoder layer in torch: RMSNorm and the MLP's activations."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Half precision: normalize in float32 like the reference implementation, then scale.
    return F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype) * weight


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU. torch's float32 erf takes another path for a lone row than for a batch
    (tests/test_families.py caught a last-bit difference); in float64 the two paths differ
    far below what the rounding to float32 keeps."""
    return F.gelu(x.double()).to(x.dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": _gelu_erf, "gelu_pytorch_tanh": _gelu_tanh}
