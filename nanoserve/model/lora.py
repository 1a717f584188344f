"""LoRA adapters: checked against the base model, fused, and each row's low-rank update applied
after the base linear (multi-LoRA serving, as vLLM's --enable-lora).

Owns: `LoRARequest` (vLLM's: a name, an integer id, a path), the checks every adapter file
passes (`check_rank`, `check_weights`; `loading.adapters` reads PEFT folders and llama.cpp's
GGUF LoRA files into `AdapterTensor`s), and `load_adapter`, which makes an `Adapter` whose
matrices sit fused like the base model's (q, k and v share the qkv output's columns, gate and
up gate_up's), with the file's scaling folded into B; `AdapterSet`, the adapters loaded (on
first use; beyond max_cpu_loras the least recently used idle one is unloaded: vLLM's LRU cache
of adapters; how many share a step, max_loras, is the scheduler's rule); and each row's update
added to a base linear's output after the base matmul ran once for the whole batch, two ways:
where the native small ops run (float32 on the CPU), every adapter of a step in one C pass per
target matrix (`native_step`, nanoserve.native.lora; inside the one-call decoder where that
runs); else `apply`, the reference, each adapter's two small matmuls over its rows alone
through a batch-invariant float kernel (the model's own, or the native float kernel beside a
GGUF model's block kernel). Either way a row's bits do not depend on which adapters its
neighbours use.
Refuses, by name, before anything is kept: a rank above max_lora_rank, a target module the
decoder has no linear for, an MLP module on a layer whose MLP is a mixture of experts, DoRA,
trained biases or modules_to_save, and a tensor whose shape does not fit the base model; an
adapter is resident whole or not at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import torch

from nanoserve.config import ModelConfig
from nanoserve.errors import InvalidRequestError
from nanoserve.native.lora import NativeAdapter, NativeLoRAStep, Piece, TargetUpdate

# PEFT's module names, and the fused base linear each one's output columns live in.
TARGETS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
           "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
# The modules of a dense MLP: a sparse layer's experts have none of them (nor LoRA support).
MLP_TARGETS = frozenset(("gate_proj", "up_proj", "down_proj"))
# Adapters kept loaded when max_cpu_loras is not set: at least this many, at least max_loras.
# An idle adapter of rank 16 on a small model is a few MB, and a reload reads its file again.
MAX_CPU_LORAS_FLOOR = 8


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's LoRARequest: which adapter a request runs with. `lora_int_id` is the client's
    handle (unique per adapter, >= 1); `lora_path` a PEFT adapter folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"lora_name must be a non-empty string; got {self.lora_name!r}",
                                      param="lora_name")
        int_id = self.lora_int_id
        if not isinstance(int_id, int) or isinstance(int_id, bool) or int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be an integer >= 1; got {self.lora_int_id!r}",
                                      param="lora_int_id")


@dataclass(frozen=True, slots=True)
class FusedUpdate:
    """One base linear's update: out[rows] += (x[rows] @ A^T) @ B^T, A and B packed for the
    model's linear kernel (A [R, in], B [out, R], B scaled)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(slots=True)
class Adapter:
    name: str
    lora_int_id: int
    path: str
    rank: int
    cache_key: str  # the prefix cache's namespace: one per load, so a reloaded name never hits old K/V
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the kernel A and B are packed for
    layers: list[dict[str, FusedUpdate]] = field(default_factory=list)  # [layer][fused target]; torch path
    native: NativeAdapter | None = None  # the C tables, in place of `layers`, where the C code runs it


def refuse(path: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"the LoRA adapter at {path}: {message}", param="lora_path")


@dataclass(frozen=True, slots=True)
class AdapterTensor:
    """One A or B matrix as a file holds it, named for messages, placed by layer and PEFT module."""

    key: str  # the file's name for it
    layer: int
    module: str  # q_proj, ..., down_proj
    which: str  # "A" [rank, in] or "B" [out, rank], in Hugging Face's row order
    tensor: torch.Tensor


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """An adapter read whole and checked against the base model: each layer's (A, B) per PEFT
    module, float32, and the scaling its update is multiplied by."""

    rank: int
    scaling: float
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]


def check_rank(path: str, rank: object, max_rank: int) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(path, f"r must be an integer >= 1; got {rank!r}")
    if rank > max_rank:
        raise refuse(path, f"its rank r={rank} is above max_lora_rank={max_rank}")
    return rank


def check_weights(path: str, model: ModelConfig, rank: int, scaling: float,
                  tensors: Iterable[AdapterTensor]) -> AdapterWeights:
    """The tensors as one adapter, or a refusal naming the first that does not fit the base
    model (its layer, its shape) and the first module with A but no B or B but no A."""
    per_layer: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(model.num_layers)]
    for entry in tensors:
        if entry.layer >= model.num_layers:
            raise refuse(path, f"tensor {entry.key!r} names layer {entry.layer}; the base model has "
                               f"{model.num_layers}")
        if entry.module in MLP_TARGETS and model.is_sparse(entry.layer):
            raise refuse(path, f"tensor {entry.key!r} targets {entry.module} of layer {entry.layer}, whose "
                               "MLP is a mixture of experts: LoRA on experts is not supported (attention "
                               "modules are)")
        expected = ((rank, _input_width(model, entry.module)) if entry.which == "A"
                    else (_output_columns(model)[entry.module][2], rank))
        if tuple(entry.tensor.shape) != expected:
            raise refuse(path, f"tensor {entry.key!r} has shape {list(entry.tensor.shape)}; the base model "
                               f"needs {list(expected)}")
        per_layer[entry.layer].setdefault(entry.module, {})[entry.which] = entry.tensor.float()
    for index, modules in enumerate(per_layer):
        for module, pair in modules.items():
            if set(pair) != {"A", "B"}:
                missing = "A" if "A" not in pair else "B"
                raise refuse(path, f"layer {index} {module} has no lora_{missing}")
    layers = [{module: (pair["A"], pair["B"]) for module, pair in modules.items()} for modules in per_layer]
    return AdapterWeights(rank, scaling, layers)


def _output_columns(config: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """(fused output width, first column, width) of each PEFT module's output."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    qkv, inter = q + 2 * kv, config.intermediate_size
    return {"q_proj": (qkv, 0, q), "k_proj": (qkv, q, kv), "v_proj": (qkv, q + kv, kv),
            "o_proj": (config.hidden_size, 0, config.hidden_size),
            "gate_proj": (2 * inter, 0, inter), "up_proj": (2 * inter, inter, inter),
            "down_proj": (config.hidden_size, 0, config.hidden_size)}


def _input_width(config: ModelConfig, module: str) -> int:
    return {"o_proj": config.num_heads * config.head_dim,
            "down_proj": config.intermediate_size}.get(module, config.hidden_size)


def load_adapter(request: LoRARequest, weights: AdapterWeights, model: ModelConfig, *, serial: int,
                 pack: Callable[[torch.Tensor], torch.Tensor],
                 matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 device: torch.device, native: bool = False) -> Adapter:
    """The checked weights fused by target: as tables for the C code (`native`, float32 on the
    CPU: nanoserve.native.lora), else packed for a batch-invariant float kernel (`pack`, `matmul`)."""
    targets = [_fuse(modules, model, weights.scaling) for modules in weights.layers]
    adapter = Adapter(request.lora_name, request.lora_int_id, request.lora_path, weights.rank,
                      f"{request.lora_name}\0{serial}", matmul)
    if native:
        adapter.native = NativeAdapter(targets)
    else:
        widths = {target: _output_columns(model)[name][0] for name, target in TARGETS.items()}
        adapter.layers = [{target: _packed(update, widths[target], pack, dtype, device)
                           for target, update in layer.items()} for layer in targets]
    return adapter


def _fuse(modules: dict[str, tuple[torch.Tensor, torch.Tensor]], model: ModelConfig,
          scaling: float) -> dict[str, TargetUpdate]:
    """One layer's modules grouped by fused target: A stacked along the rank, each module's B
    (scaled) a piece at its module's output columns, reading its module's ranks; so one pair
    of matmuls serves q, k and v."""
    columns = _output_columns(model)
    fused: dict[str, TargetUpdate] = {}
    for target in dict.fromkeys(TARGETS.values()):
        names = [name for name in modules if TARGETS[name] == target]
        if not names:
            continue
        pieces, start = [], 0
        for name in names:
            b = modules[name][1] * scaling
            pieces.append(Piece(columns[name][1], start, b))
            start += b.shape[1]
        fused[target] = TargetUpdate(torch.cat([modules[name][0] for name in names]), tuple(pieces))
    return fused


def _packed(update: TargetUpdate, width: int, pack: Callable[[torch.Tensor], torch.Tensor],
            dtype: torch.dtype, device: torch.device) -> FusedUpdate:
    """The target's B whole [width, rank] (zeros where a module's columns meet another's ranks),
    A and B packed for the torch path's kernel."""
    b = torch.zeros(width, update.a.shape[0])
    for piece in update.pieces:
        size, rank = piece.b.shape
        b[piece.column:piece.column + size, piece.rank_start:piece.rank_start + rank] = piece.b
    return FusedUpdate(pack(update.a.to(device, dtype).contiguous()), pack(b.to(device, dtype).contiguous()))


@dataclass(slots=True)
class AdapterSet:
    """The adapters loaded, by name, least recently used first: each of rank at most
    `max_lora_rank`; at most `max_cpu_loras` (vLLM's name; None: max(max_loras,
    MAX_CPU_LORAS_FLOOR)) but for those that requests in flight hold, which are never unloaded
    (a request keeps its adapter's weights to its end in any case). `max_loras`, how many
    distinct adapters may share a step, is checked here and kept by the scheduler."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None = None
    adapters: OrderedDict[str, Adapter] = field(default_factory=OrderedDict)
    _loads: int = 0
    _unloaded_idle: set[str] = field(default_factory=set)  # names the LRU unloaded, not their owner

    def __post_init__(self) -> None:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, MAX_CPU_LORAS_FLOOR)
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1; got {value!r}", param=name)
        if self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                                      f"({self.max_loras})", param="max_cpu_loras")

    def add(self, request: LoRARequest, load: Callable[[LoRARequest, int], Adapter],
            in_use: Collection[Adapter] = ()) -> Adapter:
        """The adapter `request` names: the loaded one (same id and path), else loaded now, and
        then the least recently used beyond `max_cpu_loras` unloaded, none of `in_use` (the
        adapters of requests in flight)."""
        resident = self.adapters.get(request.lora_name)
        if resident is not None:
            if (resident.lora_int_id, resident.path) != (request.lora_int_id, request.lora_path):
                raise InvalidRequestError(f"a LoRA adapter named {request.lora_name!r} is loaded already "
                                          f"(id {resident.lora_int_id}, {resident.path})", param="lora_name")
            self.adapters.move_to_end(request.lora_name)
            return resident
        if any(a.lora_int_id == request.lora_int_id for a in self.adapters.values()):
            raise InvalidRequestError(f"lora_int_id {request.lora_int_id} belongs to another adapter",
                                      param="lora_int_id")
        self._loads += 1
        adapter = load(request, self._loads)  # a refused adapter unloads nothing
        self.adapters[request.lora_name] = adapter
        self._unloaded_idle.discard(request.lora_name)
        self._unload_idle(in_use)
        return adapter

    def _unload_idle(self, in_use: Collection[Adapter]) -> None:
        """Unload the least recently used adapters that no request holds, down to max_cpu_loras
        (the newest, just loaded, stays)."""
        held = {id(adapter) for adapter in in_use}
        idle = [name for name, adapter in list(self.adapters.items())[:-1] if id(adapter) not in held]
        for name in idle[:max(0, len(self.adapters) - self.max_cpu_loras)]:
            del self.adapters[name]
            self._unloaded_idle.add(name)

    def remove(self, name: str) -> None:
        """Unload `name`; one the LRU unloaded already is unloaded (its owner's unload succeeds)."""
        if name in self._unloaded_idle:
            self._unloaded_idle.discard(name)
            return
        if self.adapters.pop(name, None) is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")


@dataclass(frozen=True, slots=True)
class AdapterRows:
    """The rows of one step that run with `adapter`: [start, stop) ranges of the flat batch."""

    adapter: Adapter
    ranges: tuple[tuple[int, int], ...]


def native_step(groups: list[AdapterRows], rows: int) -> NativeLoRAStep | None:
    """The step's adapters for the C code (every update of a step in one call per target, or
    inside the one-call decoder), or None: no LoRA rows, or adapters loaded for the torch path."""
    if not groups or groups[0].adapter.native is None:
        return None
    if any(group.adapter.native is None for group in groups):
        raise ValueError("a step's adapters are all loaded for the C code or none is")
    return NativeLoRAStep.for_rows([group.adapter.native for group in groups],
                                   [group.ranges for group in groups], rows)


def apply(out: torch.Tensor, x: torch.Tensor, groups: list[AdapterRows], layer: int, target: str) -> None:
    """out[rows] += each adapter's update of its own rows, in place (rows without one: nothing):
    the torch path, the reference the C code is held against."""
    for group in groups:
        update, matmul = group.adapter.layers[layer].get(target), group.adapter.matmul
        if update is None:
            continue
        for start, stop in group.ranges:
            out[start:stop] += matmul(matmul(x[start:stop].contiguous(), update.a), update.b)
