"""A sparse layer's routed experts in one native call (csrc/stages/moe.c).

Owns: the C struct describing one layer's experts (built once: each expert's gate_up and down
as the model's kernel packed them), the checks a raw pointer cannot make, and
`NativeExperts.__call__`, which takes the rows and their routing (model/moe.py's `route`) and
returns each row's weighted sum over its experts: the bits of model/moe.py's loop through the
same kernels, without its per-expert trips through Python and its host read of the counts;
and `routed`, which routes the rows in the same call (the router's matmul in the float kernel,
the softmax and top-k in C), so a sparse layer's routed experts are one call with no torch op
between its parts (on a busy 2-core machine each torch op beside the pool's threads could
wait a time slice).
Each expert matrix runs in the one stage every native projection runs (csrc/stages/stage_blocks.c),
described as the one-call decoder describes its matrices (nanoserve.native.stage_matrix): the
repacked x8 and K layouts (a Q4_K_M file's Q4_K experts with Q6_K downs, an IQ4_XS file's),
F16 / BF16 and float32 panels, and stacks of those (an expert's gate and up in two formats).
Refuses: a layer it cannot run exactly as that loop does (`for_layer` is None): a matrix in no
layout the stages take, or the library off. The model then keeps the loop.
"""

from __future__ import annotations

import ctypes

import torch

from nanoserve import native
from nanoserve.native import matmul as native_matmul
from nanoserve.native.matmul import FLOAT_PANELS
from nanoserve.native.stage_matrix import StageMatrix

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Model(ctypes.Structure):
    _fields_ = [("experts", _I64), ("top_k", _I64), ("hidden", _I64), ("width", _I64), ("router", _P),
                ("renormalize", _I64), ("gate_up", _P), ("down", _P), ("formats", _P)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("x", _P), ("route", _I64), ("choices", _P), ("weights", _P), ("out", _P),
                ("expert_rows", _P), ("expert_seconds", _P)]


class NativeExperts:
    """One sparse layer's experts, ready to run a step's rows in one call. Holds references to
    every tensor whose address it passes, so none is freed under it."""

    def __init__(self, lib: ctypes.CDLL, router: torch.Tensor, gate_up: list[StageMatrix],
                 down: list[StageMatrix], width: int, top_k: int, renormalize: bool) -> None:
        """`gate_up` and `down` empty: the router alone (`route` runs, nothing else)."""
        self._run = lib.ns_moe_experts
        self._run.argtypes, self._run.restype = [_P, _P, ctypes.c_int], ctypes.c_int
        self._kept = [router, gate_up, down]
        self.count, self.top_k = router.shape[0], top_k
        self.holds_experts = bool(gate_up)
        self.hidden, self.width = router.shape[1], width
        self._gate_up = (_P * self.count)(*(m.address for m in gate_up))
        self._down = (_P * self.count)(*(m.address for m in down))
        formats = [m.format for pair in zip(gate_up, down, strict=True) for m in pair]
        self._formats = (ctypes.c_int32 * (2 * self.count))(*(formats or [FLOAT_PANELS] * 2 * self.count))
        self._model = _Model(self.count, top_k, self.hidden, self.width, router.data_ptr(), int(renormalize),
                             ctypes.addressof(self._gate_up), ctypes.addressof(self._down),
                             ctypes.addressof(self._formats))

    @property
    def layer_address(self) -> int:
        """The address of this layer's C struct (csrc/stages/stages.h's ns_moe_layer), for the one-call
        decoder, which runs it as a stage; valid while this object lives."""
        return ctypes.addressof(self._model)

    @classmethod
    def router_only(cls, router: object, top_k: int, *, renormalize: bool,
                    float_panels: bool) -> NativeExperts | None:
        """The routing alone of a layer whose experts are split by output across ranks (the loop
        runs them, routed to the bits one rank's call routes them), or None as `for_layer`."""
        library = native.library()
        if library is None or not isinstance(router, torch.Tensor) or router.dtype != torch.float32:
            return None
        if not router.is_cpu:
            return None
        router = router if float_panels else native_matmul.pack(router.contiguous())
        return cls(library.lib, router, [], [], 0, top_k, renormalize)

    @classmethod
    def for_layer(cls, router: object, gate_up: list[object], down: list[object], top_k: int, *,
                  renormalize: bool, float_panels: bool) -> NativeExperts | None:
        """The native experts of one layer (the router [experts, hidden], each expert's gate_up
        [2 * width, hidden] and down [hidden, width], as the model's kernel packed them;
        `float_panels`: dense ones are in nanoserve.native.matmul's panels, else the float
        router is packed here), or None where it cannot run them as the loop does."""
        library = native.library()
        if library is None or not gate_up or not isinstance(router, torch.Tensor):
            return None
        if router.dtype != torch.float32 or not router.is_cpu:
            return None
        router = router if float_panels else native_matmul.pack(router.contiguous())
        hidden, width = gate_up[0].shape[1], down[0].shape[1]
        if any(tuple(m.shape) != (2 * width, hidden) for m in gate_up) or any(
                tuple(m.shape) != (hidden, width) for m in down):
            return None
        gate_up = [StageMatrix.of(m, float_panels) for m in gate_up]
        down = [StageMatrix.of(m, float_panels) for m in down]
        if None in gate_up or None in down:
            return None
        if any(not t.is_contiguous() or not t.is_cpu for m in (*gate_up, *down) for t in m.tensors()):
            return None
        if (any(m.reads_quantized for m in gate_up) and hidden % 32) or (
                any(m.reads_quantized for m in down) and width % 32):
            return None
        return cls(library.lib, router, gate_up, down, width, top_k, renormalize)

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *,
                 expert_rows: torch.Tensor | None = None,
                 expert_seconds: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """Each row's sum of weight * expert(row) over its top_k experts, in ascending expert
        index. x float32 [rows, hidden]; `experts` int64 and `weights` float32 [rows, top_k]
        (distinct experts within a row). `expert_rows` (int64) and `expert_seconds` (float64),
        [experts] each: when given, each expert's routed rows and its matmuls' wall time are
        added to them (the profile). `threads`: the call's thread count (None:
        `native.thread_count`'s), as for `routed` and `route`."""
        shape = (x.shape[0], self.top_k)
        if experts.dtype != torch.int64 or tuple(experts.shape) != shape:
            raise ValueError(f"experts must be int64 {list(shape)}; got {experts.dtype} "
                             f"{list(experts.shape)}")
        if weights.dtype != torch.float32 or tuple(weights.shape) != shape:
            raise ValueError(f"weights must be float32 {list(shape)}; got {weights.dtype} "
                             f"{list(weights.shape)}")
        return self._call(x, experts.contiguous(), weights.contiguous(), False, expert_rows, expert_seconds,
                          threads=threads)

    def routed(self, x: torch.Tensor, *, expert_rows: torch.Tensor | None = None,
               expert_seconds: torch.Tensor | None = None,
               threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows routed here too (the router's logits, softmax, top_k, renormalised as
        model/moe.py's `route`, to its last bits rather than torch's): (out, experts, weights)."""
        experts = torch.empty(x.shape[0], self.top_k, dtype=torch.int64)
        weights = torch.empty(x.shape[0], self.top_k, dtype=torch.float32)
        out = self._call(x, experts, weights, True, expert_rows, expert_seconds, threads=threads)
        return out, experts, weights

    def route(self, x: torch.Tensor, *, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the routing `routed` does, to the same bits: (experts, weights) [rows, top_k]
        (for the loop under tensor parallelism on blocks, so N ranks route as one rank does)."""
        experts = torch.empty(x.shape[0], self.top_k, dtype=torch.int64)
        weights = torch.empty(x.shape[0], self.top_k, dtype=torch.float32)
        self._call(x, experts, weights, True, None, None, run_experts=False, threads=threads)
        return experts, weights

    def _call(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, route: bool,
              expert_rows: torch.Tensor | None, expert_seconds: torch.Tensor | None, *,
              run_experts: bool = True, threads: int | None) -> torch.Tensor:
        if run_experts and not self.holds_experts:
            raise RuntimeError("this layer's native call holds its router alone: only `route` runs")
        rows = x.shape[0]
        if x.dtype != torch.float32 or tuple(x.shape) != (rows, self.hidden) or not x.is_cpu:
            raise ValueError(f"x must be float32 [rows, {self.hidden}] on the CPU; got {x.dtype} "
                             f"{list(x.shape)} on {x.device}")
        for name, tally, dtype in (("expert_rows", expert_rows, torch.int64),
                                   ("expert_seconds", expert_seconds, torch.float64)):
            if tally is not None and (tally.dtype != dtype or tuple(tally.shape) != (self.count,)
                                      or not tally.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous {dtype} [{self.count}] tensor")
        x = x.contiguous()
        out = torch.empty_like(x)
        step = _Step(rows, x.data_ptr(), int(route), experts.data_ptr(), weights.data_ptr(),
                     out.data_ptr() if run_experts else None,
                     None if expert_rows is None else expert_rows.data_ptr(),
                     None if expert_seconds is None else expert_seconds.data_ptr())
        threads = native.thread_count(threads)
        status = self._run(ctypes.addressof(self._model), ctypes.addressof(step), threads)
        if status == -3:
            raise IndexError(f"expert indices must lie in [0, {self.count})")
        native.raise_for_status(status, "native experts", f"the experts {self.count} x {self.width}", rows)
        return out
