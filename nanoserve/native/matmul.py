"""Float matrix multiplies in C: y = x @ W^T for float32 and bfloat16 weights (csrc/matmul_float.c).

Owns: the C functions' argument types, packing a weight [N, K] into the kernel's panel layout
once (`pack`), and `matmul`, which checks every tensor before its pointer reaches C (a wrong
pointer is a segfault, not an exception). A packed weight keeps W's shape and dtype, but its
memory is in panels of 16 output columns, K-major (matmul_float.c describes the layout), so
only `matmul` may read it.
Refuses: float16 and other dtypes (no kernel: `UnsupportedDtypeError`, a RuntimeError, so
the kernel choice leaves this kernel out for them), non-contiguous or non-CPU tensors,
shapes that do not multiply, and running without the library (`NativeUnavailableError`).
A row's result is the same fused multiply-add chain over K whatever the rest of the call
holds and whatever the thread count, so this kernel is batch-invariant by construction.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from nanoserve import native

DTYPES = (torch.float32, torch.bfloat16)
PANEL = 16  # csrc/matmul_float.c's PANEL: output columns per packed panel
# The format number csrc/decoder.c and csrc/moe.c give a float32 matrix in these panels (a
# repacked block matrix has its GGML type's number).
FLOAT_PANELS = 0


class NativeUnavailableError(RuntimeError):
    """The library is off (no compiler, failed build, NANOSERVE_NO_NATIVE=1)."""


class UnsupportedDtypeError(RuntimeError):
    """No native float kernel for this dtype."""


@dataclass(frozen=True, slots=True)
class _Functions:
    by_dtype: dict[torch.dtype, ctypes._CFuncPtr]
    portable_by_dtype: dict[torch.dtype, ctypes._CFuncPtr]
    portable_fused: bool  # the portable path's chain is fused, so it equals the ISA path's bits


_bound: list[tuple[native.NativeLibrary, _Functions]] = []  # the library last bound, and its functions


def _functions() -> _Functions | None:
    """The bound functions, or None when the library is off."""
    return native.bound(_bound, _bind)


def _bind(lib: ctypes.CDLL) -> _Functions:
    arguments = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    for name in ("ns_matmul_f32", "ns_matmul_f32_portable", "ns_matmul_bf16", "ns_matmul_bf16_portable"):
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, ctypes.c_int
    lib.ns_matmul_float_panel.restype = lib.ns_matmul_float_portable_fused.restype = ctypes.c_int
    if lib.ns_matmul_float_panel() != PANEL:
        raise NativeUnavailableError(f"the library packs {lib.ns_matmul_float_panel()} columns, not {PANEL}")
    return _Functions(
        {torch.float32: lib.ns_matmul_f32, torch.bfloat16: lib.ns_matmul_bf16},
        {torch.float32: lib.ns_matmul_f32_portable, torch.bfloat16: lib.ns_matmul_bf16_portable},
        bool(lib.ns_matmul_float_portable_fused()))


def available() -> bool:
    return _functions() is not None


def portable_is_fused() -> bool:
    """Whether the portable path uses a fused multiply-add (then its bits equal the ISA path's)."""
    functions = _require()
    return functions.portable_fused


def _require() -> _Functions:
    functions = _functions()
    if functions is None:
        raise NativeUnavailableError(native.status())
    return functions


def _check_dtype(tensor: torch.Tensor, name: str) -> None:
    if tensor.dtype not in DTYPES:
        raise UnsupportedDtypeError(
            f"{name}: no native float kernel for {str(tensor.dtype).removeprefix('torch.')} "
            "(float32 and bfloat16 only)")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] in panels of 16 output columns, K-major; the last N % 16 columns as a narrower
    panel. bfloat16 panels interleave each k step's columns as c0 c8 c1 c9 ... c7 c15."""
    _check_dtype(weight, "weight")
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"weight: expected a 2-D CPU tensor [out, in], got {tuple(weight.shape)} "
                         f"on {weight.device}")
    n, k = weight.shape
    full = n - n % PANEL
    packed = torch.empty(n * k, dtype=weight.dtype)
    panels = weight[:full].reshape(-1, PANEL, k)
    if weight.dtype == torch.bfloat16:
        # [panel, high half, column in half, k] -> [panel, k, column in half, high half]
        panels = panels.view(-1, 2, PANEL // 2, k).permute(0, 3, 2, 1)
    else:
        panels = panels.transpose(1, 2)
    packed[: full * k].view(panels.shape).copy_(panels)
    packed[full * k :].view(k, n - full).copy_(weight[full:].t())
    return packed.view(n, k)


def matmul(x: torch.Tensor, packed: torch.Tensor, *, threads: int | None = None,
           portable: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in the weight's dtype, for `packed` = pack(W); x has W's dtype.
    `portable` runs the plain C path instead of the ISA one (for the tests)."""
    functions = _require()
    # Checked in the cheapest order: this runs for every linear of every step.
    if x.dtype is not packed.dtype:
        _check_dtype(packed, "weight")
        raise ValueError(f"x: dtype {x.dtype} does not match the weight's {packed.dtype}")
    if x.dim() != 2 or packed.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x: shape {tuple(x.shape)} does not multiply a weight of shape "
                         f"{tuple(packed.shape)} (expected [M, {packed.shape[-1]}])")
    if not (x.is_cpu and packed.is_cpu):
        raise ValueError(f"x and weight must be on the CPU, got {x.device} and {packed.device}")
    if not (x.is_contiguous() and packed.is_contiguous()):
        raise ValueError("x and weight must be contiguous")
    function = (functions.portable_by_dtype if portable else functions.by_dtype).get(x.dtype)
    if function is None:
        _check_dtype(x, "x")
    m, (n, k) = x.shape[0], packed.shape
    y = torch.empty(m, n, dtype=x.dtype)
    if m == 0 or n == 0:
        return y
    if function(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k,
                threads or torch.get_num_threads()) != 0:
        raise MemoryError(f"cannot allocate {m} x {k} widened activations")
    return y
