"""Float matrix multiplies in C: y = x @ W^T for float32 and bfloat16 weights, and for a GGUF
file's F16 and BF16 matrices (csrc/gemm/matmul_float.c).

Owns: the C functions' argument types, packing a weight [N, K] into the kernel's panel layout
once (`pack`), and `matmul`, which checks every tensor before its pointer reaches C (a wrong
pointer is a segfault, not an exception). A packed weight keeps W's shape and dtype, but its
memory is in panels of 16 output columns, K-major (matmul_float.c describes the layout), so
only `matmul` may read it. Also `HalfPanels`: a GGUF F16 / BF16 matrix (a QuantizedWeight of
one-value blocks) in the same panels, its file values regrouped (`pack_half`), multiplied by
float32 activations (`matmul_half`) and looked up by row (a tied token table kept once).
Refuses: float16 models and other dtypes (no kernel: `UnsupportedDtypeError`, a RuntimeError,
so the kernel choice leaves this kernel out for them; a GGUF F16 matrix runs as HalfPanels),
non-contiguous or non-CPU tensors, shapes that do not multiply, and running without the
library (`NativeUnavailableError`).
A row's result is the same fused multiply-add chain over K whatever the rest of the call
holds and whatever the thread count, so this kernel is batch-invariant by construction.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from nanoserve import native
from nanoserve.quant import BlockFormat, PackedBlocks, QuantizedWeight

DTYPES = (torch.float32, torch.bfloat16)
PANEL = 16  # csrc/gemm/matmul_float.c's PANEL: output columns per packed panel
F32_PANELS = 0  # the GGML type number of float32, which names float32 panels to the library
# The format number csrc/stages/decoder.c and csrc/stages/moe.c give a float32 matrix in these panels (a
# repacked block matrix has its GGML type's number, and so does HalfPanels: 1 or 30).
FLOAT_PANELS = 0
# The GGUF types HalfPanels holds, and the dtype their 2-byte values are
HALF_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


class NativeUnavailableError(RuntimeError):
    """The library is off (no compiler, failed build, NANOSERVE_NO_NATIVE=1)."""


class UnsupportedDtypeError(RuntimeError):
    """No native float kernel for this dtype."""


@dataclass(frozen=True, slots=True)
class _Functions:
    by_dtype: dict[torch.dtype, ctypes._CFuncPtr]
    portable_by_dtype: dict[torch.dtype, ctypes._CFuncPtr]
    half: ctypes._CFuncPtr  # (ggml type, x, w, y, m, n, k, threads): HalfPanels on float32 x
    half_portable: ctypes._CFuncPtr
    on_isa: ctypes._CFuncPtr  # (isa, ggml type, x, w, y, m, n, k, threads): float32 x on a named ISA
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
    for name in ("ns_matmul_half_panels", "ns_matmul_half_panels_portable"):
        function = getattr(lib, name)
        function.argtypes, function.restype = [ctypes.c_int, *arguments], ctypes.c_int
    lib.ns_matmul_float_isa.argtypes = [ctypes.c_int, ctypes.c_int, *arguments]
    lib.ns_matmul_float_isa.restype = ctypes.c_int
    lib.ns_matmul_float_panel.restype = lib.ns_matmul_float_portable_fused.restype = ctypes.c_int
    if lib.ns_matmul_float_panel() != PANEL:
        raise NativeUnavailableError(f"the library packs {lib.ns_matmul_float_panel()} columns, not {PANEL}")
    return _Functions(
        {torch.float32: lib.ns_matmul_f32, torch.bfloat16: lib.ns_matmul_bf16},
        {torch.float32: lib.ns_matmul_f32_portable, torch.bfloat16: lib.ns_matmul_bf16_portable},
        lib.ns_matmul_half_panels, lib.ns_matmul_half_panels_portable, lib.ns_matmul_float_isa,
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
    return _panels(weight)


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """`pack`'s layout for a float32, bfloat16 or float16 [N, K] (float16 columns in order)."""
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
           portable: bool = False, isa: str | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in the weight's dtype, for `packed` = pack(W); x has W's dtype.
    `threads`: the caller's thread count (None: `native.thread_count`'s); `portable` runs the
    plain C path instead of the ISA one, `isa` (float32 only) one of nanoserve.native.ISAS that
    runs here (for the tests: every path gives the same bits)."""
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
    if isa is not None:
        if x.dtype != torch.float32:
            raise ValueError(f"isa: only float32 calls name an ISA, got {x.dtype}")
        _run_on_isa(functions, isa, F32_PANELS, x, packed, y, threads)
        return y
    if function(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k,
                native.thread_count(threads)) != 0:
        raise MemoryError(f"cannot allocate {m} x {k} widened activations")
    return y


# ---- a GGUF file's F16 / BF16 matrices -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HalfPanels(PackedBlocks):
    """A GGUF F16 or BF16 matrix [out, in] in `pack`'s panels: `blocks` is float16 or bfloat16
    [out, in], the file's values regrouped (only `matmul_half` and `lookup` read it). Its
    activations and outputs are float32, like every block format's."""

    format: BlockFormat  # the file's: f16 or bf16
    shape: tuple[int, int]  # (out_features, in_features)
    blocks: torch.Tensor

    def lookup(self, ids: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
        """Rows `ids` as float32 [*ids.shape, in] (a tied token table's embedding lookups): the
        file's values, widened exactly (in torch: `threads` is the repacked layouts' argument)."""
        n, k = self.shape
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise IndexError(f"row ids must lie in [0, {n})")
        full = n - n % PANEL
        panel, column = flat // PANEL, flat % PANEL
        in_full = flat < full
        # where value (row, 0) sits, and how far apart its k steps are
        if self.format.name == "bf16":  # c0 c8 c1 c9 ... c7 c15
            column = torch.where(column < PANEL // 2, 2 * column, 2 * (column - PANEL // 2) + 1)
        start = torch.where(in_full, panel * PANEL * k + column, full * k + (flat - full))
        step = torch.where(in_full, PANEL, n - full)
        at = start.unsqueeze(1) + step.unsqueeze(1) * torch.arange(k)
        return self.blocks.reshape(-1)[at].float().reshape(*ids.shape, k)

    def dequantize(self) -> torch.Tensor:
        return self.lookup(torch.arange(self.shape[0]))


def half_packable(weight: object) -> bool:
    """A GGUF matrix of a type HalfPanels holds, on the CPU."""
    return (isinstance(weight, QuantizedWeight) and weight.format.name in HALF_DTYPES
            and weight.device.type == "cpu")


def pack_half(weight: QuantizedWeight) -> HalfPanels:
    """A GGUF F16 / BF16 matrix in the panels: its bytes regrouped, nothing converted."""
    if not half_packable(weight):
        raise UnsupportedDtypeError(f"no float panels for {getattr(weight, 'format', type(weight))} "
                                    f"(GGUF f16 and bf16 matrices on the CPU only)")
    values = weight.blocks.contiguous().view(HALF_DTYPES[weight.format.name])  # [out, in]
    return HalfPanels(weight.format, weight.shape, _panels(values))


def matmul_half(x: torch.Tensor, weight: HalfPanels, *, threads: int | None = None,
                portable: bool = False, isa: str | None = None) -> torch.Tensor:
    """x [M, in] float32 @ W^T -> float32 [M, out], for `weight` = pack_half(W); `portable` runs
    the plain C path, `isa` one of nanoserve.native.ISAS that runs here (for the tests)."""
    functions = _require()
    n, k = weight.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"x must be float32 [rows, {k}] on the CPU; got {x.dtype} {list(x.shape)} "
                         f"on {x.device}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0] == 0 or n == 0:
        return y
    if isa is not None:
        _run_on_isa(functions, isa, weight.format.ggml_type, x, weight.blocks, y, threads)
        return y
    function = functions.half_portable if portable else functions.half
    status = function(weight.format.ggml_type, x.data_ptr(), weight.blocks.data_ptr(), y.data_ptr(),
                      x.shape[0], n, k, native.thread_count(threads))
    native.raise_for_status(status, "float panels matmul", f"{weight.format.name} {weight.shape}", n)
    return y


def _run_on_isa(functions: _Functions, isa: str, ggml_type: int, x: torch.Tensor, panels: torch.Tensor,
                y: torch.Tensor, threads: int | None) -> None:
    """y = x @ W^T on ISA `isa`, float32 x and y (operands checked by the caller)."""
    if isa not in native.ISAS:
        raise ValueError(f"isa: {isa!r} is not one of {', '.join(native.ISAS)}")
    if functions.on_isa(native.ISAS.index(isa), ggml_type, x.data_ptr(), panels.data_ptr(), y.data_ptr(),
                        x.shape[0], y.shape[1], x.shape[1], native.thread_count(threads)) != 0:
        raise ValueError(f"isa: {isa} does not run here")
