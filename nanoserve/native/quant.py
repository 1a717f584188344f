"""The native kernels on GGUF weights in their file's bytes, behind torch-shaped calls.

Owns: which C file runs each format in the file's layout (csrc/gemm/matmul_quant.c: Q8_0, Q4_0, Q4_1,
Q4_K, Q5_K, Q6_K; csrc/gemm/matmul_more.c: Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K, F16, BF16; the
repacking kernels hold F16 and BF16 in nanoserve.native.matmul's panels instead), the ctypes signatures
of their entry points (a matmul, its portable twin, and a row lookup each), and the checks a
raw pointer cannot make for itself (dtype, contiguity, shapes), done before every call: a wrong
pointer is a segfault, not an exception.
Refuses: to run without the library; `runs(format)` says whether it can, and callers take the
torch path (nanoserve.quant) otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from nanoserve import native
from nanoserve.quant import BlockFormat, QuantizedWeight

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


@dataclass(frozen=True, slots=True)
class _Entries:
    matmul: str
    portable: str
    lookup: str


_QUANT = _Entries("ns_matmul_quant", "ns_matmul_quant_portable", "ns_dequantize_rows")
_MORE = _Entries("ns_matmul_more", "ns_matmul_more_portable", "ns_dequantize_rows_more")
# The formats csrc/gemm/matmul_more.c runs; every other one in nanoserve.quant.FORMATS is matmul_quant.c's.
MORE_FORMATS = frozenset({"q5_0", "q5_1", "iq4_nl", "iq4_xs", "q2_k", "q3_k", "f16", "bf16"})


def _entries(fmt: BlockFormat) -> _Entries:
    return _MORE if fmt.name in MORE_FORMATS else _QUANT


@functools.cache
def _lib() -> ctypes.CDLL | None:
    loaded = native.library()
    if loaded is None:
        return None
    lib = loaded.lib
    matmul_args = [ctypes.c_int, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int]
    lookup_args = [ctypes.c_int, _P, _P, _I64, _I64, _I64, _P, ctypes.c_int]
    for entries in (_QUANT, _MORE):
        for name, args in ((entries.matmul, matmul_args), (entries.portable, matmul_args),
                           (entries.lookup, lookup_args)):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
    return lib


def runs(fmt: BlockFormat) -> bool:
    """Whether the native library is loaded (it runs every format in nanoserve.quant.FORMATS)."""
    return _lib() is not None


def matmul(x: torch.Tensor, weight: QuantizedWeight, *, portable: bool = False,
           threads: int | None = None) -> torch.Tensor:
    """x [rows, in] float32 @ weight^T -> float32 [rows, out], on `threads` threads (None:
    `native.thread_count`'s)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError(native.status())
    out_features, in_features = weight.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features or x.device.type != "cpu":
        raise ValueError(f"x must be float32 [rows, {in_features}] on the CPU; got {x.dtype} "
                         f"{list(x.shape)} on {x.device}")
    x = x.contiguous()
    blocks = weight.blocks.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0]:
        entries = _entries(weight.format)
        entry = getattr(lib, entries.portable if portable else entries.matmul)
        status = entry(weight.format.ggml_type, x.data_ptr(), blocks.data_ptr(), y.data_ptr(),
                       x.shape[0], out_features, in_features, native.thread_count(threads))
        _raise_for(status, weight)
    return y


def dequantize_rows(weight: QuantizedWeight, ids: torch.Tensor, *,
                    threads: int | None = None) -> torch.Tensor:
    """Rows `ids` of `weight` as float32 [*ids.shape, in] (embedding lookups)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError(native.status())
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), weight.shape[1], dtype=torch.float32)
    if flat.numel():
        entry = getattr(lib, _entries(weight.format).lookup)
        status = entry(weight.format.ggml_type, weight.blocks.contiguous().data_ptr(), flat.data_ptr(),
                       flat.numel(), weight.shape[0], weight.shape[1], out.data_ptr(),
                       native.thread_count(threads))
        _raise_for(status, weight)
    return out.reshape(*ids.shape, weight.shape[1])


def _raise_for(status: int, weight: QuantizedWeight) -> None:
    what = f"{weight.format.name} {weight.shape}"
    native.raise_for_status(status, "quantized matmul", what, weight.shape[0])
