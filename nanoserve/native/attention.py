"""Tiled attention over the paged KV cache in C (csrc/stages/attention.c), bound through ctypes.

Owns: the kernel's signature, the checks that make a call safe before a raw pointer reaches C
(dtypes, contiguity, shapes; a q8_0 cache's scales), the cache dtype codes the C side reads,
and which vector paths this CPU runs (`isas`). The arithmetic (partitions of the context merged
in order, tiles under an online softmax, GQA heads sharing each K/V row) is csrc/stages/attention.c's
and is batch-invariant by construction: a row's bits depend on its q, its context and its
position only (and, inside a bidirectional image, that image's last slot: `visible_ends`), on
every path (the portable C reference, AVX2, AVX-512 agree bit for bit).
Refuses: activations other than float32, devices other than the CPU, and a cache dtype it does
not read (`KV_DTYPE_CODES`); the model then attends in torch.
"""

from __future__ import annotations

import ctypes

import torch

from nanoserve import native

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURE = (_INT, _P, _I64, _INT, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64,
              _I64, _F32, _I64, _F32, _INT)

# nanoserve.h's NS_KV_*: the cache storage dtypes the kernel reads (int8: q8_0 codes with scales).
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
ISAS = native.ATTENTION_ISAS
BEST = 0  # the widest path this CPU runs


class NativeOpsError(ValueError):
    """A tensor a native small-op kernel (this one, `nanoserve.native.ops`'s) cannot take (dtype,
    layout, shape): raised before any pointer is passed."""


def check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype,
                 shape: tuple[int, ...] | None = None) -> None:
    if t.dtype is not dtype or not t.is_cpu or not t.is_contiguous():
        raise NativeOpsError(f"{name} must be a contiguous {dtype} CPU tensor; got {t.dtype} on "
                                   f"{t.device}, contiguous={t.is_contiguous()}")
    if shape is not None and t.shape != shape:
        raise NativeOpsError(f"{name} must have shape {shape}; got {tuple(t.shape)}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
                v_scales: torch.Tensor | None) -> tuple[int, int | None, int | None]:
    """The caches [kv_heads, blocks, block_size, d]: float32, float16 or bfloat16 without scales,
    or int8 q8_0 codes with float32 scales [kv_heads, blocks, block_size]. Returns the dtype's
    code and the scales' addresses (None without)."""
    code = KV_DTYPE_CODES.get(k_cache.dtype)
    if code is None:
        raise NativeOpsError(f"the native kernels read float32, float16, bfloat16 or q8_0 caches; "
                                   f"got {k_cache.dtype}")
    check_tensor("k_cache", k_cache, k_cache.dtype)
    check_tensor("v_cache", v_cache, k_cache.dtype, tuple(k_cache.shape))
    if k_cache.dtype is not torch.int8:
        if k_scales is not None or v_scales is not None:
            raise NativeOpsError(f"k_cache of {k_cache.dtype} takes no scales "
                                 "(a q8_0 cache's codes are int8)")
        return code, None, None
    if k_scales is None or v_scales is None:
        raise NativeOpsError("a q8_0 cache needs both k_scales and v_scales")
    check_tensor("k_scales", k_scales, torch.float32, tuple(k_cache.shape[:3]))
    check_tensor("v_scales", v_scales, torch.float32, tuple(k_cache.shape[:3]))
    return code, k_scales.data_ptr(), v_scales.data_ptr()


class NativeAttention:
    """The kernel of one loaded library, on path `isa` (BEST: the widest this CPU runs)."""

    def __init__(self, lib: ctypes.CDLL, isa: int = BEST) -> None:
        self._attend = lib.ns_tiled_attention
        self._attend.argtypes, self._attend.restype = _SIGNATURE, ctypes.c_int
        lib.ns_attention_isas.restype = ctypes.c_int
        self.available = lib.ns_attention_isas()
        if isa != BEST and not self.available & isa:
            raise NativeOpsError(f"this CPU does not run attention path {isa}")
        self.isa = isa

    def isas(self) -> list[str]:
        """The names of the paths this CPU runs."""
        return native.attention_isas(self.available)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor, heads: int,
                 scale: float, *, window: int = 0, softcap: float = 0.0, out: torch.Tensor | None = None,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                 visible_ends: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """Attention of every row over its sequence's context in the paged cache, read in place.

        q [rows, >= heads * d] float32 with unit stride inside a row (a view of the qkv
        projection is fine); caches [kv_heads, blocks, block_size, d]; block_tables [seqs,
        width], row_seq and positions [rows], int64 (their values' bounds are the caller's to
        check: `model.batch.paged_context` does); -> [rows, heads * d]. `window` > 0 limits a
        row to its last `window` slots; `softcap` > 0 soft-caps the scores (Gemma 2).
        `visible_ends` [rows] int64: the last slot each row sees where it is past its position
        (a bidirectional image's rows see the whole image; the window still counts back from the
        position); None: each row's position (bounds, and each >= its position, the caller's).
        """
        kv_heads, blocks, block_size, dim = k_cache.shape
        rows = q.shape[0]
        if q.dtype != torch.float32 or not q.is_cpu or q.stride(-1) != 1 or q.shape[1] < heads * dim:
            raise NativeOpsError(f"q must be float32 CPU rows of at least {heads * dim} unit-stride values")
        code, k_scales_at, v_scales_at = check_cache(k_cache, v_cache, k_scales, v_scales)
        check_tensor("block_tables", block_tables, torch.int64)
        check_tensor("row_seq", row_seq, torch.int64, (rows,))
        check_tensor("positions", positions, torch.int64, (rows,))
        if visible_ends is not None:
            check_tensor("visible_ends", visible_ends, torch.int64, (rows,))
        if heads % kv_heads:
            raise NativeOpsError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
        if out is None:
            out = q.new_empty(rows, heads * dim)
        check_tensor("out", out, torch.float32, (rows, heads * dim))
        status = self._attend(self.isa, q.data_ptr(), q.stride(0), code, k_cache.data_ptr(), k_scales_at,
                              v_cache.data_ptr(), v_scales_at, block_tables.data_ptr(), block_tables.shape[1],
                              row_seq.data_ptr(), positions.data_ptr(),
                              None if visible_ends is None else visible_ends.data_ptr(), out.data_ptr(), rows,
                              heads, kv_heads, dim, block_size, blocks, scale, window, softcap,
                              native.thread_count(threads))
        if status == -2:
            raise MemoryError("the attention's scratch could not be allocated")
        if status != 0:
            raise NativeOpsError(f"the attention kernel refused the call (status {status})")
        return out
