"""A sparse layer's routed experts in one native call (csrc/moe.c).

Owns: the C struct describing one layer's experts (built once: each expert's gate_up and down
as the model's kernel packed them), the checks a raw pointer cannot make, and
`NativeExperts.__call__`, which takes the rows and their routing (model/moe.py's `route`) and
returns each row's weighted sum over its experts: the bits of model/moe.py's loop through the
same kernels, without its per-expert trips through Python and its host read of the counts.
Refuses: a layer it cannot run exactly as that loop does (`for_layer` is None): a matrix
neither in the repacked layout (nanoserve.native.repack) nor float32 in nanoserve.native.matmul's
panels, or the library off. The model then keeps the loop.
"""

from __future__ import annotations

import ctypes

import torch

from nanoserve import native
from nanoserve.native.decoder import FLOAT_PANELS

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Model(ctypes.Structure):
    _fields_ = [("experts", _I64), ("top_k", _I64), ("hidden", _I64), ("width", _I64), ("gate_up", _P),
                ("down", _P), ("formats", _P)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("x", _P), ("choices", _P), ("weights", _P), ("out", _P), ("expert_rows", _P),
                ("expert_seconds", _P)]


def _format(matrix: object, float_panels: bool) -> int | None:
    """csrc/moe.c's format number of a packed matrix, or None where it cannot run it."""
    from nanoserve.native.repack import RepackedWeight

    if isinstance(matrix, RepackedWeight):
        return matrix.layout.ggml_type
    if float_panels and isinstance(matrix, torch.Tensor) and matrix.dtype == torch.float32 and matrix.is_cpu:
        return FLOAT_PANELS
    return None


def _storage(matrix: object) -> torch.Tensor:
    return matrix if isinstance(matrix, torch.Tensor) else matrix.blocks


class NativeExperts:
    """One sparse layer's experts, ready to run a step's rows in one call. Holds references to
    every tensor whose address it passes, so none is freed under it."""

    def __init__(self, lib: ctypes.CDLL, gate_up: list[object], down: list[object], formats: list[int],
                 top_k: int) -> None:
        self._run = lib.ns_moe_experts
        self._run.argtypes, self._run.restype = [_P, _P, ctypes.c_int], ctypes.c_int
        self._kept = [gate_up, down]
        self.count, self.top_k = len(gate_up), top_k
        self.hidden, self.width = gate_up[0].shape[1], down[0].shape[1]
        self._gate_up = (_P * self.count)(*(_storage(m).data_ptr() for m in gate_up))
        self._down = (_P * self.count)(*(_storage(m).data_ptr() for m in down))
        self._formats = (ctypes.c_int32 * len(formats))(*formats)
        self._model = _Model(self.count, top_k, self.hidden, self.width, ctypes.addressof(self._gate_up),
                             ctypes.addressof(self._down), ctypes.addressof(self._formats))

    @classmethod
    def for_layer(cls, gate_up: list[object], down: list[object], top_k: int, *,
                  float_panels: bool) -> NativeExperts | None:
        """The native experts of one layer (each expert's gate_up [2 * width, hidden] and down
        [hidden, width], as the model's kernel packed them; `float_panels`: dense ones are in
        nanoserve.native.matmul's panels), or None where it cannot run them as the loop does."""
        library = native.library()
        if library is None or not gate_up:
            return None
        formats = [f for up, dn in zip(gate_up, down, strict=True)
                   for f in (_format(up, float_panels), _format(dn, float_panels))]
        if None in formats or any(not _storage(m).is_contiguous() for m in (*gate_up, *down)):
            return None
        hidden, width = gate_up[0].shape[1], down[0].shape[1]
        if any(tuple(m.shape) != (2 * width, hidden) for m in gate_up) or any(
                tuple(m.shape) != (hidden, width) for m in down):
            return None
        if (any(formats[0::2]) and hidden % 32) or (any(formats[1::2]) and width % 32):
            return None
        return cls(library.lib, gate_up, down, formats, top_k)

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *,
                 expert_rows: torch.Tensor | None = None,
                 expert_seconds: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's sum of weight * expert(row) over its top_k experts, in ascending expert
        index. x float32 [rows, hidden]; `experts` int64 and `weights` float32 [rows, top_k]
        (distinct experts within a row). `expert_rows` (int64) and `expert_seconds` (float64),
        [experts] each: when given, each expert's routed rows and its matmuls' wall time are
        added to them (the profile)."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or tuple(x.shape) != (rows, self.hidden) or not x.is_cpu:
            raise ValueError(f"x must be float32 [rows, {self.hidden}] on the CPU; got {x.dtype} "
                             f"{list(x.shape)} on {x.device}")
        shape = (rows, self.top_k)
        if experts.dtype != torch.int64 or tuple(experts.shape) != shape:
            raise ValueError(f"experts must be int64 {list(shape)}; got {experts.dtype} "
                             f"{list(experts.shape)}")
        if weights.dtype != torch.float32 or tuple(weights.shape) != shape:
            raise ValueError(f"weights must be float32 {list(shape)}; got {weights.dtype} "
                             f"{list(weights.shape)}")
        for name, tally, dtype in (("expert_rows", expert_rows, torch.int64),
                                   ("expert_seconds", expert_seconds, torch.float64)):
            if tally is not None and (tally.dtype != dtype or tuple(tally.shape) != (self.count,)
                                      or not tally.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous {dtype} [{self.count}] tensor")
        x, experts, weights = x.contiguous(), experts.contiguous(), weights.contiguous()
        out = torch.empty_like(x)
        step = _Step(rows, x.data_ptr(), experts.data_ptr(), weights.data_ptr(), out.data_ptr(),
                     None if expert_rows is None else expert_rows.data_ptr(),
                     None if expert_seconds is None else expert_seconds.data_ptr())
        status = self._run(ctypes.addressof(self._model), ctypes.addressof(step), torch.get_num_threads())
        if status == -3:
            raise IndexError(f"expert indices must lie in [0, {self.count})")
        native.raise_for_status(status, "native experts", f"the experts {self.count} x {self.width}", rows)
        return out
