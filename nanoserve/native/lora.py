"""LoRA's low-rank updates in C (csrc/stages/lora.c): every adapter of a step in one pass per target
matrix, as a call of its own (the per-layer loop) or as stages of the one-call decoder.

Owns: an adapter's tables as the C code reads them (`NativeAdapter`: per layer and fused
target, A stacked over the target's modules and each module's B transposed, scaled, placed by
output columns), one step's rows (`NativeLoRAStep`: each row's adapter slot, the tables by
slot, the scratch of x @ A^T), and `NativeLoRAStep.apply`, which checks what a raw pointer
cannot before the call.
Refuses: tensors that are not contiguous float32 on the CPU, and running without the library
(`available()` is False; adapters then keep the torch path, nanoserve.model.lora's `apply`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from nanoserve import native

_P, _I64 = ctypes.c_void_p, ctypes.c_int64

TARGET_ORDER = ("qkv", "o", "gate_up", "down")  # csrc/stages/decoder.c's QKV, O, GATE_UP, DOWN
PIECES = 3  # csrc/stages/stages.h's NS_LORA_PIECES


class _Piece(ctypes.Structure):
    _fields_ = [("column", _I64), ("width", _I64), ("rank_start", _I64), ("rank", _I64), ("bt", _P)]


class _Update(ctypes.Structure):
    _fields_ = [("a", _P), ("rank", _I64), ("pieces", _I64), ("piece", _Piece * PIECES)]


class _Step(ctypes.Structure):
    _fields_ = [("updates", _P), ("row_slot", _P), ("shrunk", _P), ("max_rank", _I64)]


@dataclass(frozen=True, slots=True)
class Piece:
    """One module's share of a fused target: B [width, rank] (scaled) writes output columns
    [column, column + width) from ranks [rank_start, rank_start + rank) of the target's A."""

    column: int
    rank_start: int
    b: torch.Tensor


@dataclass(frozen=True, slots=True)
class TargetUpdate:
    """One fused target's update: A stacked over its modules [rank, in], and their pieces."""

    a: torch.Tensor
    pieces: tuple[Piece, ...]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name in ("ns_lora_apply", "ns_lora_apply_portable"):
        function = getattr(lib, name)
        function.argtypes = [_P, _I64, _P, _P, _I64, _I64, _I64, ctypes.c_int]
        function.restype = ctypes.c_int
    lib.ns_lora_portable_fused.restype = lib.ns_lora_pieces.restype = ctypes.c_int
    return lib


_bound: list[tuple[native.NativeLibrary, ctypes.CDLL]] = []  # the library last bound


def _library() -> ctypes.CDLL | None:
    """The library with the LoRA functions bound, or None when it is off."""
    return native.bound(_bound, _bind)


def available() -> bool:
    """Whether adapters can run in C here (the library is built and loads)."""
    lib = _library()
    return lib is not None and lib.ns_lora_pieces() == PIECES


def portable_is_fused() -> bool:
    """Whether the portable path's chains are fused (then its bits equal the AVX2 path's)."""
    return bool(_library().ns_lora_portable_fused())


class NativeAdapter:
    """One adapter's tables, [layer * 4 + target] in TARGET_ORDER; holds every tensor whose
    address they hold."""

    def __init__(self, layers: list[dict[str, TargetUpdate]]) -> None:
        self._kept: list[torch.Tensor] = []
        self.table = (_Update * (len(TARGET_ORDER) * len(layers)))()
        self.max_rank = 0
        # [layer * 4 + target]: (input width, output columns the pieces reach), for the checks
        self.shapes: dict[int, tuple[int, int]] = {}
        self._fits: tuple[int, tuple[tuple[int, int], ...]] | None = None
        for index, targets in enumerate(layers):
            for order, target in enumerate(TARGET_ORDER):
                update = targets.get(target)
                if update is not None:
                    at = index * len(TARGET_ORDER) + order
                    self._fill(self.table[at], update)
                    self.shapes[at] = (update.a.shape[1], max(p.column + p.b.shape[0] for p in update.pieces))

    def check(self, layers: int, widths: tuple[tuple[int, int], ...]) -> None:
        """That the tables fit a model of `layers` layers whose targets read and write
        (input width, output columns) `widths` (checked once per model shape)."""
        if self._fits == (layers, widths):
            return
        if len(self.table) != layers * len(TARGET_ORDER):
            raise ValueError(f"the adapter has {len(self.table) // len(TARGET_ORDER)} layers; the model "
                             f"{layers}")
        for at, (k, columns) in self.shapes.items():
            width_in, width_out = widths[at % len(TARGET_ORDER)]
            if k != width_in or columns > width_out:
                target = TARGET_ORDER[at % len(TARGET_ORDER)]
                raise ValueError(f"the adapter's {target} update reads {k} inputs and writes {columns} "
                                 f"columns; the model's reads {width_in}, writes {width_out}")
        self._fits = (layers, widths)

    def _fill(self, entry: _Update, update: TargetUpdate) -> None:
        if len(update.pieces) > PIECES:
            raise ValueError(f"a target holds at most {PIECES} modules; got {len(update.pieces)}")
        a = self._keep(update.a)
        entry.a, entry.rank, entry.pieces = a.data_ptr(), a.shape[0], len(update.pieces)
        for slot, piece in zip(entry.piece, update.pieces, strict=False):
            bt = self._keep(piece.b.t())
            slot.column, slot.rank_start, slot.bt = piece.column, piece.rank_start, bt.data_ptr()
            slot.rank, slot.width = bt.shape
        self.max_rank = max(self.max_rank, a.shape[0])

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        kept = tensor.detach().to("cpu", torch.float32).contiguous().clone()
        self._kept.append(kept)
        return kept


class NativeLoRAStep:
    """One step's LoRA rows for the C code: row r runs with adapters[row_slot[r]] (-1: none)."""

    def __init__(self, adapters: list[NativeAdapter], row_slot: torch.Tensor) -> None:
        if row_slot.dtype != torch.int32 or row_slot.dim() != 1 or not row_slot.is_contiguous():
            raise ValueError("row_slot must be a contiguous 1-D int32 tensor")
        if not adapters:
            raise ValueError("a LoRA step needs at least one adapter")
        # Checked inside torch, not read back (the C code indexes the tables by it).
        torch._assert_async(((row_slot >= -1) & (row_slot < len(adapters))).all(),
                            f"row_slot must lie in [-1, {len(adapters)})")
        self._run = _library().ns_lora_apply
        self._adapters = adapters
        self._row_slot = row_slot
        self._tables = (_P * len(adapters))(*(ctypes.addressof(a.table) for a in adapters))
        self.rows = row_slot.shape[0]
        max_rank = max(a.max_rank for a in adapters)
        self._shrunk = torch.empty(self.rows, max_rank)
        self.struct = _Step(ctypes.addressof(self._tables), row_slot.data_ptr(), self._shrunk.data_ptr(),
                            max_rank)

    @classmethod
    def for_rows(cls, adapters: list[NativeAdapter], ranges: list[tuple[tuple[int, int], ...]],
                 rows: int) -> NativeLoRAStep:
        """Adapter i's rows are `ranges[i]`, [start, stop) of the step's `rows`."""
        row_slot = torch.full((rows,), -1, dtype=torch.int32)
        for slot, spans in enumerate(ranges):
            for start, stop in spans:
                if not 0 <= start <= stop <= rows:
                    raise ValueError(f"adapter rows [{start}, {stop}) must lie in the step's {rows} rows")
                row_slot[start:stop] = slot
        return cls(adapters, row_slot)

    def check(self, layers: int, widths: tuple[tuple[int, int], ...], rows: int) -> None:
        """That the step's `rows` rows and its adapters fit a model of `layers` layers whose
        targets (TARGET_ORDER) read and write (input width, output columns) `widths`."""
        if rows != self.rows:
            raise ValueError(f"the LoRA rows describe {self.rows} rows; the step has {rows}")
        for adapter in self._adapters:
            adapter.check(layers, widths)

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, target: str, *,
              portable: bool = False, threads: int | None = None) -> None:
        """out [rows, n] += each row's update of `target` in `layer`, x [rows, k] its input, on
        `threads` threads (None: `native.thread_count`'s)."""
        for name, t in (("out", out), ("x", x)):
            if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu or t.dim() != 2:
                raise ValueError(f"{name} must be a contiguous 2-D float32 CPU tensor")
            if t.shape[0] != self.rows:
                raise ValueError(f"{name} has {t.shape[0]} rows; the step has {self.rows}")
        at = layer * len(TARGET_ORDER) + TARGET_ORDER.index(target)
        for adapter in self._adapters:
            k, columns = adapter.shapes.get(at, (x.shape[1], 0))
            if x.shape[1] != k or out.shape[1] < columns:
                raise ValueError(f"an adapter's {target} update of layer {layer} reads {k} inputs and writes "
                                 f"{columns} columns; got x {tuple(x.shape)}, out {tuple(out.shape)}")
        run = _library().ns_lora_apply_portable if portable else self._run
        run(ctypes.addressof(self.struct), at, x.data_ptr(), out.data_ptr(), self.rows, out.shape[1],
            x.shape[1], native.thread_count(threads))
