"""The forward's small ops in C (csrc/stages/ops.c): RMSNorm (with the residual add fused, or over
each q and k head), RoPE with the K/V write into the paged cache, SiLU(gate)*up and GELU's tanh
form (gate)*up; and attention over the paged cache in place
(csrc/stages/attention.c, bound in `nanoserve.native.attention`). The cache's K and V are float32,
float16, bfloat16, or q8_0 (int8 codes with one float32 scale per row: `k_scales` and
`v_scales`, model/kv_cache.py), converted by the write and read a row at a time by the attention.

Owns: the ctypes signatures of those kernels and the checks that make a call safe (dtype,
contiguity, shapes) before a raw pointer reaches C, where a wrong one is a segfault rather than
an exception. `NativeOps` is what the model calls, each op on the thread count its caller
passes (None: `native.thread_count`'s); `portable=True` runs the plain C path the tests hold
the vector path against.
Refuses: dtypes other than float32 (the model then keeps its torch ops) and devices other than
the CPU. The attention here is batch-invariant by construction (csrc/stages/attention.c says how); it
does not reproduce the torch attention's bits, so a model runs one or the other for every row.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from nanoserve import native
from nanoserve.native.attention import ISAS, NativeAttention, NativeOpsError, check_cache

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rms_norm": (_P, _P, _P, _I64, _I64, _F32, _INT),
    "add_rms_norm": (_P, _P, _P, _P, _I64, _I64, _F32, _INT),
    "silu_mul": (_P, _P, _I64, _I64, _INT),
    "gelu_tanh_mul": (_P, _P, _I64, _I64, _INT),
    "head_rms_norm": (_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _INT),
}
_SINGLE = {"rope_write_kv": (_P, _P, _P, _P, _P, _INT, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT)}
# RoPE keeps one head on the stack.
MAX_HEAD_DIM = 1024


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> None:
    # A few hundred nanoseconds: this runs on every call, about 120 calls a step.
    if t.dtype is not dtype or not t.is_cpu or not t.is_contiguous():
        raise NativeOpsError(f"{name} must be a contiguous {dtype} CPU tensor; got {t.dtype} on "
                             f"{t.device}, contiguous={t.is_contiguous()}")
    if shape is not None and t.shape != shape:
        raise NativeOpsError(f"{name} must have shape {shape}; got {tuple(t.shape)}")


def _output(name: str, out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`out` checked, or a new tensor: callers reuse one buffer across layers to skip allocations."""
    if out is None:
        return like.new_empty(shape)
    _check(name, out, torch.float32, shape)
    return out


@dataclass(frozen=True, slots=True)
class PagedContext:
    """Where each row's context lives, built once per step for every layer: row r attends over
    sequence row_seq[r]'s block table up to positions[r] (its own slot included), or up to
    visible_ends[r] where given (a bidirectional image's rows see the whole image). Types and
    shapes are checked here; the values' bounds (a sequence in the table, a position inside its
    blocks, a block inside the cache) are the builder's to check, once per step, as
    `model.paged_context` does."""

    block_tables: torch.Tensor  # [seqs, width] int64: cache blocks of each sequence
    row_seq: torch.Tensor  # [rows] int64: each row's sequence
    positions: torch.Tensor  # [rows] int64
    visible_ends: torch.Tensor | None = None  # [rows] int64, each >= its row's position; None: positions

    def __post_init__(self) -> None:  # once per step, not once per layer
        _check("block_tables", self.block_tables, torch.int64)
        _check("row_seq", self.row_seq, torch.int64)
        _check("positions", self.positions, torch.int64, self.row_seq.shape)
        if self.visible_ends is not None:
            _check("visible_ends", self.visible_ends, torch.int64, self.row_seq.shape)

    @property
    def rows(self) -> int:
        return self.row_seq.shape[0]


class NativeOps:
    """The kernels of one loaded library, on the vector path or (portable=True) the plain one.
    Every op takes an optional `out` buffer (checked like the inputs)."""

    def __init__(self, lib: ctypes.CDLL, *, portable: bool = False) -> None:
        suffix = "_portable" if portable else ""
        for name, argtypes in {**_SIGNATURES, **_SINGLE}.items():
            fn = getattr(lib, f"ns_{name}{suffix if name in _SIGNATURES else ''}")
            fn.argtypes, fn.restype = argtypes, None
            setattr(self, f"_{name}", fn)
        self.portable = portable
        self.attention = NativeAttention(lib, ISAS["portable"] if portable else 0)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, *, threads: int | None = None) -> torch.Tensor:
        """RMSNorm of each row of x [rows, dim]."""
        _check("x", x, torch.float32)
        rows, dim = x.shape
        _check("weight", weight, torch.float32, (dim,))
        out = _output("out", out, x, x.shape)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps,
                       native.thread_count(threads))
        return out

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None, *, threads: int | None = None) -> torch.Tensor:
        """residual += delta (in place), and the RMSNorm of the sum."""
        _check("residual", residual, torch.float32)
        rows, dim = residual.shape
        _check("delta", delta, torch.float32, residual.shape)
        _check("weight", weight, torch.float32, (dim,))
        out = _output("out", out, residual, residual.shape)
        self._add_rms_norm(residual.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                           rows, dim, eps, native.thread_count(threads))
        return out

    def head_rms_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int,
                      kv_heads: int, eps: float, *, threads: int | None = None) -> None:
        """RMSNorm over each of the `heads` q heads (by q_weight) and `kv_heads` k heads (by
        k_weight) that start each row of qkv [rows, width], in place."""
        _check("qkv", qkv, torch.float32)
        dim = q_weight.shape[0]
        _check("q_weight", q_weight, torch.float32, (dim,))
        _check("k_weight", k_weight, torch.float32, (dim,))
        rows, width = qkv.shape
        if (heads + kv_heads) * dim > width:
            raise NativeOpsError(f"qkv rows of {width} values hold no {heads} + {kv_heads} heads of {dim}")
        self._head_rms_norm(qkv.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), rows, width, heads,
                            kv_heads, dim, eps, native.thread_count(threads))

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None, *,
                 threads: int | None = None) -> torch.Tensor:
        """SiLU(gate) * up of gate_up [rows, 2 * width] (gate first): [rows, width]."""
        return self._gated(self._silu_mul, gate_up, out, threads)

    def gelu_tanh_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None, *,
                      threads: int | None = None) -> torch.Tensor:
        """GELU's tanh form (gelu_pytorch_tanh) of gate, times up, as `silu_mul`."""
        return self._gated(self._gelu_tanh_mul, gate_up, out, threads)

    def _gated(self, kernel, gate_up: torch.Tensor, out: torch.Tensor | None,
               threads: int | None) -> torch.Tensor:
        _check("gate_up", gate_up, torch.float32)
        rows, double = gate_up.shape
        if double % 2:
            raise NativeOpsError(f"gate_up must have an even width; got {double}")
        out = _output("out", out, gate_up, (rows, double // 2))
        kernel(gate_up.data_ptr(), out.data_ptr(), rows, double // 2, native.thread_count(threads))
        return out

    def rope_write_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      signed_sin: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, heads: int, k_scales: torch.Tensor | None = None,
                      v_scales: torch.Tensor | None = None, *, threads: int | None = None) -> None:
        """Rotate q in place in qkv [rows, (heads + 2 kv_heads) * d]; write rotated k and v into
        the caches [kv_heads, blocks, block_size, d] at slot_mapping's flat slots (float16 and
        bfloat16 caches: rounded to nearest even; q8_0 caches: quantized, each row's scale into
        k_scales / v_scales)."""
        kv_heads, blocks, block_size, dim = k_cache.shape
        rows = qkv.shape[0]
        _check("qkv", qkv, torch.float32, (rows, (heads + 2 * kv_heads) * dim))
        kv_dtype, k_scales_at, v_scales_at = check_cache(k_cache, v_cache, k_scales, v_scales)
        _check("cos", cos, torch.float32, (cos.shape[0], dim))
        _check("signed_sin", signed_sin, torch.float32, tuple(cos.shape))
        _check("positions", positions, torch.int64, (rows,))
        _check("slot_mapping", slot_mapping, torch.int64, (rows,))
        if dim > MAX_HEAD_DIM or dim % 2:
            raise NativeOpsError(f"head_dim must be even and at most {MAX_HEAD_DIM}; got {dim}")
        self._rope_write_kv(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
                            slot_mapping.data_ptr(), kv_dtype, k_cache.data_ptr(), k_scales_at,
                            v_cache.data_ptr(), v_scales_at, rows, heads, kv_heads, dim, blocks * block_size,
                            native.thread_count(threads))

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        context: PagedContext, heads: int, scale: float, window: int = 0,
                        out: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                        v_scales: torch.Tensor | None = None, softcap: float = 0.0, *,
                        threads: int | None = None) -> torch.Tensor:
        """Attention of every row over its sequence's context in the paged cache, read in place
        (`NativeAttention.__call__` says what each argument is), on this object's path."""
        if context.rows != q.shape[0]:
            raise NativeOpsError(f"the context describes {context.rows} rows; q has {q.shape[0]}")
        return self.attention(q, k_cache, v_cache, context.block_tables, context.row_seq, context.positions,
                              heads, scale, window=window, softcap=softcap, out=out, k_scales=k_scales,
                              v_scales=v_scales, visible_ends=context.visible_ends, threads=threads)


def load(*, portable: bool = False) -> NativeOps | None:
    """The native ops of this machine's library, or None where it is off (`native.status()` says why)."""
    library = native.library()
    return None if library is None else NativeOps(library.lib, portable=portable)
