"""A projection as the native stages read it (csrc/stages/stage_blocks.c's `ns_stage_blocks`): its format
number and the address it passes. The one-call decoder (nanoserve.native.decoder) and a sparse
layer's experts (nanoserve.native.moe) both describe their matrices through `StageMatrix.of`, so
which packed matrix runs in which layout is decided here once.

Owns: the format of a packed matrix: a repacked layout (nanoserve.native.repack: the x8 and K
layouts), a GGUF F16 / BF16 matrix in nanoserve.native.matmul's panels (HalfPanels), a stack of
parts in those (as a Q4_K_M file mixes them: csrc/stages/stages.h's ns_stacked_blocks, built here and
kept alive with the arrays it points at), or float32 in nanoserve.native.matmul's panels.
Refuses: anything else (`of` is None), and the caller keeps its loop of separate calls.
"""

from __future__ import annotations

import ctypes

import torch

from nanoserve.native.matmul import FLOAT_PANELS, HalfPanels

STACKED = -1  # csrc/stages/stages.h's NS_STACKED: parts in different block layouts, side by side

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Stack(ctypes.Structure):  # stages.h's ns_stacked_blocks
    _fields_ = [("parts", _I64), ("formats", _P), ("columns", _P), ("blocks", _P)]


def _layout(matrix: object) -> int | None:
    """The layout's number (a GGML type) of a repacked matrix or of a GGUF F16 / BF16 one in
    panels, else None."""
    from nanoserve.native.repack import KRepackedWeight, RepackedWeight

    if isinstance(matrix, RepackedWeight):
        return matrix.layout.ggml_type
    if isinstance(matrix, KRepackedWeight | HalfPanels):
        return matrix.format.ggml_type
    return None


class StageMatrix:
    """One projection as csrc/stages/stage_blocks.c reads it: its format number and the address it
    passes (a stack's: its ns_stacked_blocks, kept here with the arrays it points at)."""

    def __init__(self, matrix: object, fmt: int) -> None:
        self.format, self._kept = fmt, matrix
        if matrix is None:
            self.address = None
            return
        if fmt != STACKED:
            self.address = (matrix if isinstance(matrix, torch.Tensor) else matrix.blocks).data_ptr()
            return
        parts = matrix.parts
        self._arrays = ((ctypes.c_int32 * len(parts))(*(_layout(p) for p in parts)),
                        (_I64 * len(parts))(*(p.shape[0] for p in parts)),
                        (_P * len(parts))(*(p.blocks.data_ptr() for p in parts)))
        self._stack = _Stack(len(parts), *(ctypes.addressof(a) for a in self._arrays))
        self.address = ctypes.addressof(self._stack)

    @classmethod
    def of(cls, matrix: object, float_panels: bool) -> StageMatrix | None:
        """The matrix as the native stages run it (`float_panels`: a float32 tensor is in
        nanoserve.native.matmul's panels), or None where they cannot."""
        from nanoserve.quant import QuantizedStack

        if (layout := _layout(matrix)) is not None:
            return cls(matrix, layout)
        if isinstance(matrix, QuantizedStack) and all(_layout(p) is not None for p in matrix.parts):
            return cls(matrix, STACKED)
        if float_panels and isinstance(matrix, torch.Tensor) and matrix.dtype == torch.float32:
            return cls(matrix, FLOAT_PANELS)
        return None

    @classmethod
    def absent(cls) -> StageMatrix:
        """A matrix the stages never read (a sparse layer's dense MLP in the decoder)."""
        return cls(None, FLOAT_PANELS)

    @property
    def reads_quantized(self) -> bool:
        """Whether its stage reads the input in 8-bit blocks of 32 (csrc/stages/stage_blocks.c's
        ns_stage_reads_quantized): a block layout, or a stack with one among its parts."""
        parts = self._kept.parts if self.format == STACKED else (self._kept,)
        return any(_layout(p) is not None and not isinstance(p, HalfPanels) for p in parts)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors whose addresses it passes."""
        if self._kept is None:
            return []
        if isinstance(self._kept, torch.Tensor):
            return [self._kept]
        return [p.blocks for p in self._kept.parts] if self.format == STACKED else [self._kept.blocks]
