"""GGUF blocks repacked at load for csrc/matmul_x8.c: eight output columns interleaved per block.

Owns: `RepackedWeight` (the layout matmul_x8.c documents: per group of 8 output columns and
per 32-value block, the 8 scales side by side, then the codes in 4-byte chunks of each column
in turn), `repack` (a QuantizedWeight -> its repacked form, the file's bytes reordered; Q4_0
goes into the Q4_1 layout with m = -8 d), `matmul` and `lookup` (a tied head's table serving
the embedding's row lookups, so the table is resident once), each checked before a pointer
reaches C.
Refuses: the formats it has no layout for (`repackable` says which: Q4_0, Q4_1, Q8_0); the
kernel choice leaves those matrices in their file layout for matmul_quant.c.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from nanoserve import native
from nanoserve.quant import FORMATS, BlockFormat, QuantizedWeight

COLUMNS = 8  # csrc/matmul_x8.c's COLUMNS: output columns interleaved per group
# The layout each format is repacked into (a GGML type number: csrc/matmul_x8.c's X8_*).
LAYOUT = {"q4_0": FORMATS["q4_1"], "q4_1": FORMATS["q4_1"], "q8_0": FORMATS["q8_0"]}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class RepackedWeight:
    """A matrix [out, in] in matmul_x8.c's layout: `blocks` is uint8 [groups, in / 32 *
    8 * layout.bytes], group g holding output features 8g..8g+7 (zero columns past `out`)."""

    source: BlockFormat  # the file's format
    layout: BlockFormat  # the block format the groups hold (Q4_0 is held as Q4_1)
    shape: tuple[int, int]  # (out_features, in_features)
    blocks: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32 [*ids.shape, in] (a tied token table's embedding lookups)."""
        return lookup(self, ids)


def repackable(weight: object) -> bool:
    return isinstance(weight, QuantizedWeight) and weight.format.name in LAYOUT


def repack(weight: QuantizedWeight) -> RepackedWeight | QuantizedWeight:
    """`weight` in the interleaved layout; itself where there is no layout for its format (or
    Q4_0 with a scale too large for m = -8 d in f16)."""
    if not repackable(weight):
        return weight
    out_features, in_features = weight.shape
    blocks = weight.blocks.reshape(out_features, in_features // 32, weight.format.bytes)
    if weight.format.name == "q4_0":
        d = blocks[..., :2].contiguous()
        m = (d.view(torch.float16) * -8).contiguous()
        if not torch.isfinite(m).all():
            return weight
        blocks = torch.cat([d, m.view(torch.uint8), blocks[..., 2:]], dim=-1)
    layout = LAYOUT[weight.format.name]
    scale_bytes = 4 if layout.name == "q4_1" else 2
    padded = torch.zeros(-(-out_features // COLUMNS) * COLUMNS, *blocks.shape[1:], dtype=torch.uint8)
    padded[:out_features] = blocks
    groups = padded.view(-1, COLUMNS, *blocks.shape[1:])  # [group, column, block, bytes]
    count, _, per_row, _ = groups.shape
    # -> [group, block, field, column, 2]: the columns' d side by side, then their m
    scales = groups[..., :scale_bytes].reshape(count, COLUMNS, per_row, -1, 2).permute(0, 2, 3, 1, 4)
    # -> [group, block, chunk, column, 4]: 4 code bytes of each column in turn
    codes = groups[..., scale_bytes:].reshape(count, COLUMNS, per_row, -1, 4).permute(0, 2, 3, 1, 4)
    packed = torch.cat([scales.reshape(count, per_row, -1), codes.reshape(count, per_row, -1)], dim=-1)
    return RepackedWeight(weight.format, layout, weight.shape, packed.reshape(count, -1).contiguous())


@functools.cache
def _lib() -> ctypes.CDLL | None:
    loaded = native.library()
    if loaded is None:
        return None
    lib = loaded.lib
    for name in ("ns_matmul_x8", "ns_matmul_x8_portable"):
        getattr(lib, name).argtypes = [ctypes.c_int, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int
    lib.ns_dequantize_rows_x8.argtypes = [ctypes.c_int, _P, _P, _I64, _I64, _I64, _P, ctypes.c_int]
    lib.ns_dequantize_rows_x8.restype = ctypes.c_int
    return lib


def _require() -> ctypes.CDLL:
    lib = _lib()
    if lib is None:
        raise RuntimeError(native.status())
    return lib


def matmul(x: torch.Tensor, weight: RepackedWeight, *, portable: bool = False) -> torch.Tensor:
    """x [rows, in] float32 @ weight^T -> float32 [rows, out]. `portable` runs the plain C path
    (for the tests: it gives the vector path's bits)."""
    lib = _require()
    out_features, in_features = weight.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features or x.device.type != "cpu":
        raise ValueError(f"x must be float32 [rows, {in_features}] on the CPU; got {x.dtype} "
                         f"{list(x.shape)} on {x.device}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0]:
        entry = lib.ns_matmul_x8_portable if portable else lib.ns_matmul_x8
        status = entry(weight.layout.ggml_type, x.data_ptr(), weight.blocks.data_ptr(), y.data_ptr(),
                       x.shape[0], out_features, in_features, torch.get_num_threads())
        _raise_for(status, weight)
    return y


def lookup(weight: RepackedWeight, ids: torch.Tensor) -> torch.Tensor:
    lib = _require()
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), weight.shape[1], dtype=torch.float32)
    if flat.numel():
        status = lib.ns_dequantize_rows_x8(weight.layout.ggml_type, weight.blocks.data_ptr(), flat.data_ptr(),
                                           flat.numel(), weight.shape[0], weight.shape[1], out.data_ptr(),
                                           torch.get_num_threads())
        _raise_for(status, weight)
    return out.reshape(*ids.shape, weight.shape[1])


def _raise_for(status: int, weight: RepackedWeight) -> None:
    what = f"{weight.source.name} {weight.shape} repacked"
    native.raise_for_status(status, "repacked matmul", what, weight.shape[0])
