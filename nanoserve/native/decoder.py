"""Every decoder layer of a step in one native call (csrc/stages/decoder.c), for the Llama stack,
its MLPs dense or routed experts (Mixtral), and the switches of the families around it that the
stages take (decoder.c lists them: Gemma 2 and 3, Qwen3, sliding windows).

Owns: the C structs that describe the model (built once: norms, the repacked matrices of
each layer, its RoPE table and window) and one step (rows, positions, slots, block tables, the buffers
the stages write, the LoRA rows' adapters: nanoserve.native.lora), the checks a raw pointer
cannot make, and `NativeDecoder.run`, which takes the same step data the per-op path takes and
leaves the same bits: the stages are the exported kernels' own code. A sparse layer runs its
experts' one call (nanoserve.native.moe) as a stage, to that call's bits.
Refuses: any layer it cannot run exactly as the per-op native path does (`for_layers` is
None): an activation other than SiLU and GELU's tanh form, more than `MAX_WINDOWS` distinct
windows, a switch on some layers only, a matrix in no layout the stages take
(nanoserve.native.stage_matrix says which: the repacked x8 and K layouts, F16 / BF16 and
float32 panels, stacks of those), a width not whole blocks of 32, a sparse layer without its
experts' native call, or the library off. The model then keeps its loop of separate calls.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from nanoserve import native
from nanoserve.native.attention import check_cache
from nanoserve.native.lora import NativeLoRAStep
from nanoserve.native.ops import PagedContext
from nanoserve.native.stage_matrix import StageMatrix

if TYPE_CHECKING:
    from nanoserve.native.moe import NativeExperts

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Model(ctypes.Structure):
    _fields_ = [("layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("eps", _F32), ("scale", _F32), ("input_norm", _P), ("post_norm", _P),
                ("matrices", _P), ("formats", _P), ("k_cache", _P), ("v_cache", _P), ("block_size", _I64),
                ("num_blocks", _I64), ("cos", _P), ("signed_sin", _P), ("k_scales", _P), ("v_scales", _P),
                ("kv_dtype", _I64), ("moe", _P), ("windows", _P), ("q_norm", _P), ("k_norm", _P),
                ("attn_out_norm", _P), ("mlp_out_norm", _P), ("softcap", _F32), ("activation", _I64)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("table_width", _I64), ("positions", _P), ("slot_mapping", _P),
                ("block_tables", _P), ("row_seq", _P), ("hidden", _P), ("delta", _P), ("normed", _P),
                ("qkv", _P), ("attended", _P), ("gate_up", _P), ("activated", _P), ("linear_seconds", _P),
                ("attention_seconds", _P), ("lora", _P), ("expert_rows", _P), ("expert_seconds", _P)]


# decoder.c's NS_ACT_*: the gate activations its stage computes (the loop's native ops, the same code).
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
MAX_WINDOWS = 4  # decoder.c's NS_DECODER_WINDOWS: one attention plan a distinct window


@dataclass(frozen=True, slots=True)
class DecoderShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    softcap: float = 0.0  # the attention scores' soft cap; 0: none
    activation: str = "silu"  # the gate's, an `ACTIVATIONS` name


@dataclass(frozen=True, slots=True)
class LayerVectors:
    """One layer's float32 vectors and tables beside its matrices; a switch the family lacks is
    None (then on every layer)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    cos: torch.Tensor  # the layer's RoPE table [positions, head_dim]
    signed_sin: torch.Tensor
    window: int = 0  # the last positions a row attends to; 0: all
    q_norm: torch.Tensor | None = None  # each q head's RMSNorm weight [head_dim], before RoPE
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma's norms of the sublayers' outputs [hidden]
    mlp_out_norm: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)]


_SWITCHES = ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
    return (_P * len(tensors))(*(t.data_ptr() for t in tensors))


class NativeDecoder:
    """One model's layers, ready to run a step in one call. Holds references to every tensor
    whose address it passes, so none is freed under it."""

    def __init__(self, lib: ctypes.CDLL, shape: DecoderShape, layers: list[LayerVectors],
                 matrices: list[StageMatrix], experts: list[NativeExperts | None]) -> None:
        self._run = lib.ns_decoder_layers
        self._run.argtypes, self._run.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
        self.shape = shape
        self._kept = [layers, matrices, experts]

        def per_layer(name: str) -> int | None:  # the address of the layers' pointers, or None: off
            if getattr(layers[0], name) is None:
                return None
            array = _pointers([getattr(layer, name) for layer in layers])
            self._kept.append(array)
            return ctypes.addressof(array)

        self._windows = (ctypes.c_int64 * len(layers))(*(layer.window for layer in layers))
        self._matrices = (_P * len(matrices))(*(m.address for m in matrices))
        self._formats = (ctypes.c_int32 * len(matrices))(*(m.format for m in matrices))
        self._experts = (_P * len(experts))(*(None if e is None else e.layer_address for e in experts))
        self.sparse_layers = sum(e is not None for e in experts)
        self.expert_count = max((e.count for e in experts if e is not None), default=0)  # the tally's width
        self._model = _Model(len(layers), shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                             shape.intermediate, shape.eps, shape.scale, per_layer("input_norm"),
                             per_layer("post_norm"), ctypes.addressof(self._matrices),
                             ctypes.addressof(self._formats), None, None, 0, 0, per_layer("cos"),
                             per_layer("signed_sin"), None, None, 0,
                             ctypes.addressof(self._experts) if self.sparse_layers else None,
                             ctypes.addressof(self._windows), *(per_layer(name) for name in _SWITCHES),
                             shape.softcap, ACTIVATIONS[shape.activation])
        self._cache: tuple[object, list[ctypes.Array]] | None = None
        # None, or the seconds the projections took so far (with their barriers), and RoPE + the
        # K/V write + attention, for the profile's split of the forward; two clock reads a stage.
        self.linear_s: float | None = None
        self.attention_s: float | None = None

    @classmethod
    def for_layers(cls, shape: DecoderShape, layers: list[LayerVectors], matrices: list[list[object]], *,
                   float_panels: bool, experts: list[NativeExperts | None] | None = None,
                   ) -> NativeDecoder | None:
        """The decoder for these layers (`layers`: each one's vectors; `matrices`: each one's
        qkv, o, gate_up, down, as the model's kernel packed them, a sparse layer's gate_up and
        down None; `float_panels`: dense ones are in nanoserve.native.matmul's panels;
        `experts`: per layer, a sparse layer's native call, else None), or None where it cannot
        run them exactly as the per-op path does."""
        library = native.library()
        if library is None or not matrices or shape.activation not in ACTIVATIONS:
            return None
        if len({layer.window for layer in layers}) > MAX_WINDOWS:
            return None
        if any(len({getattr(layer, name) is None for layer in layers}) > 1 for name in _SWITCHES):
            return None
        experts = experts or [None] * len(matrices)
        sparse = [layer[2] is None for layer in matrices]
        if any(s != (e is not None and e.holds_experts) for s, e in zip(sparse, experts, strict=True)):
            return None
        widths = (shape.hidden, shape.heads * shape.head_dim, shape.intermediate)
        packed = [StageMatrix.absent() if m is None  # a sparse layer's MLP: its experts' stage runs
                  else StageMatrix.of(m, float_panels) for layer in matrices for m in layer]
        if any(w % 32 for w in widths) or None in packed:
            return None
        vectors = [t for layer in layers for t in layer.tensors()]
        tensors = vectors + [t for m in packed for t in m.tensors()]
        if any(not t.is_contiguous() or not t.is_cpu for t in tensors):
            return None
        if any(t.dtype != torch.float32 for t in vectors):
            return None
        return cls(library.lib, shape, layers, packed, experts)

    def _bind_cache(self, kv_cache) -> None:
        """The cache's per-layer addresses and dtype, once per cache (the engine keeps one for its
        life); a q8_0 cache's scales too (None for the other dtypes)."""
        if self._cache is not None and self._cache[0] is kv_cache:
            return
        self._model.kv_dtype = check_cache(kv_cache.k[0], kv_cache.v[0], *kv_cache.scales(0))[0]
        arrays = [_pointers(list(kv_cache.k)), _pointers(list(kv_cache.v))]
        self._model.k_cache, self._model.v_cache = (ctypes.addressof(a) for a in arrays)
        self._model.k_scales = self._model.v_scales = None
        if kv_cache.k_scales is not None:
            scales = [_pointers(list(kv_cache.k_scales)), _pointers(list(kv_cache.v_scales))]
            self._model.k_scales, self._model.v_scales = (ctypes.addressof(a) for a in scales)
            arrays += scales
        self._model.block_size, self._model.num_blocks = kv_cache.block_size, kv_cache.num_blocks
        self._cache = (kv_cache, arrays)

    def run(self, hidden: torch.Tensor, slot_mapping: torch.Tensor, paged: PagedContext, kv_cache,
            normed: torch.Tensor, attended: torch.Tensor, activated: torch.Tensor,
            lora: NativeLoRAStep | None = None, *, expert_rows: torch.Tensor | None = None,
            expert_seconds: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """Every layer over the step's rows: `hidden` updated in place; returns the last
        layer's MLP output, not yet added (as the per-op loop returns it). `normed`,
        `attended`, `activated`: the step's buffers [rows, hidden / heads * head_dim /
        intermediate]; `paged` and `slot_mapping` checked by the model (model.paged_context);
        `lora`: the step's LoRA rows, each projection's adapter updates added after it.
        `expert_rows` (int64) and `expert_seconds` (float64) [experts]: when given, the sparse
        layers add each expert's routed rows and matmul time to them (the profile's tally).
        `threads`: the call's thread count (None: `native.thread_count`'s)."""
        s, rows = self.shape, hidden.shape[0]
        for name, t, width in (("hidden", hidden, s.hidden), ("normed", normed, s.hidden),
                               ("attended", attended, s.heads * s.head_dim),
                               ("activated", activated, s.intermediate)):
            if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != (rows, width):
                raise ValueError(f"{name} must be a contiguous float32 [{rows}, {width}] tensor")
        if paged.rows != rows or slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (rows,):
            raise ValueError(f"the step's context and slots must describe its {rows} rows")
        if lora is not None:
            q, qkv = s.heads * s.head_dim, (s.heads + 2 * s.kv_heads) * s.head_dim
            lora.check(self._model.layers, ((s.hidden, qkv), (q, s.hidden), (s.hidden, 2 * s.intermediate),
                                            (s.intermediate, s.hidden)), rows)
        self._bind_cache(kv_cache)
        delta = torch.empty_like(hidden)
        qkv = hidden.new_empty(rows, (s.heads + 2 * s.kv_heads) * s.head_dim)
        gate_up = hidden.new_empty(rows, 2 * s.intermediate)
        slots = slot_mapping.contiguous()
        step = _Step(rows, paged.block_tables.shape[1], paged.positions.data_ptr(), slots.data_ptr(),
                     paged.block_tables.data_ptr(), paged.row_seq.data_ptr(), hidden.data_ptr(),
                     delta.data_ptr(), normed.data_ptr(), qkv.data_ptr(), attended.data_ptr(),
                     gate_up.data_ptr(), activated.data_ptr())
        linear_s, attention_s = ctypes.c_double(0.0), ctypes.c_double(0.0)
        if self.linear_s is not None:
            step.linear_seconds = ctypes.addressof(linear_s)
        if self.attention_s is not None:
            step.attention_seconds = ctypes.addressof(attention_s)
        if lora is not None:
            step.lora = ctypes.addressof(lora.struct)
        for name, tally, dtype in (("expert_rows", expert_rows, torch.int64),
                                   ("expert_seconds", expert_seconds, torch.float64)):
            if tally is None:
                continue
            width = self.expert_count
            if tally.dtype != dtype or tuple(tally.shape) != (width,) or not tally.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {dtype} [{width}] tensor")
            setattr(step, name, tally.data_ptr())
        threads = native.thread_count(threads)
        if rows and self._run(ctypes.addressof(self._model), ctypes.addressof(step), threads):
            raise MemoryError("the native decoder could not allocate its scratch")
        if self.linear_s is not None:
            self.linear_s += linear_s.value
        if self.attention_s is not None:
            self.attention_s += attention_s.value
        return delta
