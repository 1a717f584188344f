"""The model's matrix multiplies: which kernel runs them, chosen by measurement on this machine.

Owns: the candidate linear kernels (torch's own GEMM, the same on fixed 16-row tiles, oneDNN
with weights prepacked once at load, and nanoserve's own C kernels for float32 and bfloat16,
`nanoserve.native.matmul`, when the native library is on), the batch-invariance self-test each candidate
must pass to be used in batch-invariant mode, timing them on the model's own weights at the
batch sizes the engine will run, and a per-machine cache of the verdicts, so that a second
start skips the measuring.
Refuses: assuming a kernel is fast or invariant because it was elsewhere. The same kernel is
3x apart between the CPUs of this workplace, and whether a row's bits depend on the batch
is a property of the library build and the CPU, so both are measured here, at start-up.

The self-test pins what batch invariance needs from a linear layer: every row of a call with
M rows has the bits that row has alone, for M from 1 to the most rows a decode step holds, at
any position in the call, and in a prefill-sized call, so that a request's tokens do not
depend on its neighbours, nor on whether its K/V came from a decode step or a re-prefill.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve import native, quant
from nanoserve.machine import cpu_model, vector_flags
from nanoserve.native import matmul as native_matmul
from nanoserve.native import quant as native_quant
from nanoserve.native import repack

log = logging.getLogger("nanoserve")

# The row tile of `aten-tile16`: CPU BLAS gives one code path to every row of a 16-row call.
ROW_TILE = 16
# oneDNN picks its blocking from a batch hint given at packing time; 16 rows covers a decode
# step of many requests without giving up the single-request case.
ONEDNN_BATCH_HINT = 16
# Rows of the speed probe: one request, a few, and a full decode step (capped at max rows).
PROBE_ROWS = (1, 4, 16, 32)
# And a prompt chunk, capped here: past a few panels of rows a block GEMM's cost grows with its
# rows, so this many predict a longer chunk, and the probe stays short enough for start-up.
PROBE_PREFILL_ROWS = 64
# Output features of each weight the self-test multiplies: a row's bits hang on its reduction
# over K (whole here) and on the rows beside it, not on how many columns there are, and a slice
# this wide still spans several column units per thread; the full matrices made a first start
# wait seconds for rows computed one at a time.
SELF_TEST_COLUMNS = 256
# Enough layers that the probe streams its weights from memory rather than from the L3 cache.
PROBE_MIN_BYTES = 128 << 20
# Turns of the speed probe. A turn times every candidate once at a row count, in an order
# rotated every turn, and a kernel's figure is its best turn: a neighbour's stall then slows one
# kernel's turn (which the best discards) or every kernel of the turns it spans alike. Timed
# back to back, one kernel's repeats all fell inside a stall of a second and it lost.
PROBE_TURNS = 3
# The spread of turns, as a fraction of the chosen kernel's forward, under which a margin inside
# it is cached as a tie (below GEMM_MIN_ROWS `native-quant-gemm` runs `native-quant-x8`'s code):
# a neighbour that slowed every turn of the truly faster kernel slowed turns of the others too,
# widening their spread, so a wrong verdict under this spread costs about this fraction at most.
QUIET_SPREAD = 0.10
# Bump when a kernel's code or the way they are timed changes, so verdicts cached by older code
# are measured again (the native kernels' own changes are keyed by their build's source hash).
# 7: kernels timed in alternating turns; earlier verdicts may hold a stall's flipped choice.
# 8: a prompt chunk among the probe's row counts; the self-test on each weight's first columns.
CACHE_VERSION = 8
# Rows from which `native-quant-gemm` runs the prefill GEMM: the probe's 16- and 32-row calls
# measure it against the x8 tiles, and the self-test crosses the threshold.
GEMM_MIN_ROWS = 16
# The block tiles' ISAs on which the x8 layouts' wide tiles beat the prefill GEMM (an AVX2 code) at
# 1 to 512 rows (docs/performance.md: 1.5-2.6x on Q4_0, Q4_1 and Q8_0). There the kernel choice
# cannot see the difference where the GEMM's layouts are only the head (a probe times the layers),
# so `native-quant-gemm` is left out rather than timed.
GEMM_OUTRUN_ON = ("avx512vnni",)


@dataclass(frozen=True, slots=True)
class LinearKernel:
    """One way to compute x @ W^T: `pack` runs once per weight at load, `apply` every step.

    Both take `threads=`, the thread count of the native calls they make: the engine passes its
    start-up policy's (`Startup.threads`), a caller without one None (`native.thread_count`).
    torch's kernels ignore it: they run on torch's pool, which start-up sizes to the same count."""

    name: str
    summary: str
    pack: Callable[..., torch.Tensor]  # (weight [N, K], *, threads) -> packed
    apply: Callable[..., torch.Tensor]  # (x [M, K], packed, *, threads) -> [M, N]
    device_types: tuple[str, ...]
    # Whether a model packed by it can run a step in the one-call native decoder
    # (native/decoder.py); with the others it runs the per-layer loop, which pays a trip through
    # Python, ctypes and the pool for every small op of every layer (`choose_kernel` counts it).
    one_call_decoder: bool = False


def _aten(x: torch.Tensor, weight: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    return F.linear(x, weight)


def _aten_tiled(x: torch.Tensor, weight: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -rows % ROW_TILE))
    return torch.cat([F.linear(tile, weight) for tile in padded.split(ROW_TILE)])[:rows]


def _onednn_pack(weight: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_BATCH_HINT)


def _onednn(x: torch.Tensor, packed: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _onednn_min2(x: torch.Tensor, packed: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    # oneDNN runs a lone row through a matrix-vector path that sums in another order than
    # its GEMM for 2 or more rows; a zero second row keeps every row on the GEMM path.
    if x.shape[0] != 1:
        return _onednn(x, packed)
    return _onednn(F.pad(x, (0, 0, 0, 1)), packed)[:1]


def _identity(weight: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    return weight


def _native_pack(weight: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    return native_matmul.pack(weight)  # a reordering in torch: no native call


def _native(x: torch.Tensor, packed: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    return native_matmul.matmul(x.contiguous(), packed, threads=threads)


KERNELS: dict[str, LinearKernel] = {k.name: k for k in (
    LinearKernel("aten", "torch's F.linear (MKL or cuBLAS)", _identity, _aten, ("cpu", "cuda")),
    LinearKernel("aten-tile16", "F.linear on fixed 16-row tiles", _identity, _aten_tiled, ("cpu", "cuda")),
    LinearKernel("onednn", "oneDNN, weights prepacked at load", _onednn_pack, _onednn, ("cpu",)),
    LinearKernel("onednn-min2", "oneDNN, prepacked; a lone row padded to two", _onednn_pack,
                 _onednn_min2, ("cpu",)),
    # float32 and bfloat16 only: pack raises a RuntimeError for other dtypes, so `_runnable`
    # leaves it out for them. Batch-invariant by construction (one FMA chain per output).
    LinearKernel("native", "nanoserve's C kernels, weights prepacked in 16-column panels",
                 _native_pack, _native, ("cpu",), one_call_decoder=True),
)}


def left_out(device: torch.device) -> dict[str, str]:
    """Kernels for this device type that cannot run in this process at all, and why."""
    if device.type != "cpu":
        return {}
    reasons = {}
    if not torch.backends.mkldnn.is_available():
        reasons |= {name: "torch built without oneDNN" for name in KERNELS if name.startswith("onednn")}
    if not native_matmul.available():
        status = native.status().removeprefix("native kernels: ")
        reasons["native"] = status.removesuffix("; running torch kernels")
    if (library := native.library()) is not None and library.tiles_isa in GEMM_OUTRUN_ON:
        reasons["native-quant-gemm"] = (f"the block tiles on {library.tiles_isa} run its layouts faster at "
                                        f"every row count: it would run native-quant-x8's code")
    return reasons


def _native_quant(x: torch.Tensor, weight: quant.Weight, *, threads: int | None = None) -> torch.Tensor:
    if isinstance(weight, quant.QuantizedWeight):
        return native_quant.matmul(x, weight, threads=threads)
    if isinstance(weight, repack.RepackedWeight):
        return repack.matmul(x, weight, threads=threads)
    if isinstance(weight, repack.KRepackedWeight):
        return repack.matmul_k(x, weight, threads=threads)
    if isinstance(weight, native_matmul.HalfPanels):
        return native_matmul.matmul_half(x, weight, threads=threads)
    if isinstance(weight, quant.QuantizedStack):
        return torch.cat([_native_quant(x, part, threads=threads) for part in weight.parts], dim=1)
    return _aten_tiled(x, weight)  # a matrix of a GGUF type with no kernel, dequantized at load


def _repack(weight: quant.Weight, *, threads: int | None = None) -> quant.Weight:
    """Every GGUF block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; the K-quants; IQ4_XS) in the
    8-column interleaved layouts, F16 and BF16 in the float kernel's 16-column panels (and such
    parts of a stack); a matrix with no layout (a Q4_0 / Q5_0 scale whose offset overflows f16)
    stays in the file's layout, for the row-major kernel."""
    from nanoserve.native import repack

    if isinstance(weight, quant.QuantizedStack):
        return quant.QuantizedStack(tuple(_repack(part, threads=threads) for part in weight.parts))
    if not isinstance(weight, quant.QuantizedWeight):
        return weight
    if native_matmul.half_packable(weight):
        return native_matmul.pack_half(weight)
    if repack.k_repackable(weight):
        return repack.repack_k(weight, threads=threads)
    return repack.repack(weight, threads=threads)


def _native_quant_gemm(x: torch.Tensor, weight: quant.Weight, *, threads: int | None = None) -> torch.Tensor:
    """`native-quant-x8`'s product, with calls of GEMM_MIN_ROWS rows or more on the Q4_1 and Q8_0
    layouts through the prefill GEMM (csrc/gemm/matmul_gemm.c: the same bits, a row's fixed order)."""
    if repack.has_gemm(weight) and x.shape[0] >= GEMM_MIN_ROWS:
        return repack.gemm(x, weight, threads=threads)
    if isinstance(weight, quant.QuantizedStack):
        return torch.cat([_native_quant_gemm(x, part, threads=threads) for part in weight.parts], dim=1)
    return _native_quant(x, weight, threads=threads)


# The kernels for GGUF block formats (nanoserve.quant): a model's matrices are blocks or floats.
QUANTIZED_KERNELS: dict[str, LinearKernel] = {k.name: k for k in (
    LinearKernel("native-quant", "native integer dot products on GGUF blocks, activations in 8-bit "
                 "blocks of 32", _identity, _native_quant, ("cpu",)),
    LinearKernel("native-quant-x8", "native integer dot products on blocks repacked at load, 8 output "
                 "columns interleaved (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, "
                 "IQ4_XS; F16 and BF16 in the float kernel's panels; a matrix with no layout as "
                 "native-quant)", _repack, _native_quant, ("cpu",), one_call_decoder=True),
    LinearKernel("native-quant-gemm", "native-quant-x8, prompt chunks through a register-blocked GEMM "
                 "(Q4_0, Q4_1, Q8_0)", _repack, _native_quant_gemm, ("cpu",), one_call_decoder=True),
)}


def embedding(ids: torch.Tensor, table: torch.Tensor | quant.QuantizedWeight, *,
              threads: int | None = None) -> torch.Tensor:
    """Rows `ids` of a token table, dense or quantized (then only those rows are dequantized, by
    native calls on `threads` threads), or a tied head's table in a kernel's layout that serves
    lookups (`quant.serves_lookups`)."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    if quant.serves_lookups(table):
        return table.lookup(ids, threads=threads)
    if native_quant.runs(table.format):
        return native_quant.dequantize_rows(table, ids, threads=threads)
    return table.rows(ids.reshape(-1)).dequantize().reshape(*ids.shape, table.shape[1])



def float_kernel_beside(kernel: LinearKernel, dtype: torch.dtype, device: torch.device) -> LinearKernel:
    """The kernel for a model's float matrices beside its chosen `kernel` (an image tower's, which
    stays float whatever the text model's format): `kernel` itself when it is a float kernel; beside
    a quantized kernel (whose library is on), the native float kernel where it runs `dtype` on this
    device, else torch's.
    Not timed at start-up, unlike `choose_kernel`'s verdicts (which measure decode-sized calls): a
    tower's calls are prompt-sized (1,024 rows a SigLIP tile), where the native panels ran faster
    than torch's MKL on one thread and two (docs/performance.md, "The image tower's matrices")."""
    if kernel.name in KERNELS:
        return kernel
    native_runs = device.type == "cpu" and dtype in native_matmul.DTYPES and native_matmul.available()
    return KERNELS["native" if native_runs else "aten"]


# Every kernel by name, float and quantized, in a fixed order (tensor-parallel ranks are told
# the kernel by its index here).
KERNEL_NAMES = (*KERNELS, *QUANTIZED_KERNELS)


def kernel_named(name: str) -> LinearKernel:
    return {**KERNELS, **QUANTIZED_KERNELS}[name]


def quantized_kernels_for(device: torch.device) -> list[LinearKernel]:
    if device.type != "cpu" or not native.library():
        return []
    unusable = left_out(device)
    return [k for k in QUANTIZED_KERNELS.values() if k.name not in unusable]


def kernels_for(device: torch.device) -> list[LinearKernel]:
    unusable = left_out(device)
    return [k for k in KERNELS.values() if device.type in k.device_types and k.name not in unusable]


@dataclass(frozen=True, slots=True)
class ProbeShape:
    """What the probe needs of the model: its linear weights, layer by layer, and the head."""

    layers: list[list[torch.Tensor]]  # each layer's weights [out, in], in forward order
    head: torch.Tensor

    @property
    def quantized(self) -> bool:
        """GGUF blocks (nanoserve.quant) rather than dense tensors: only quantized kernels run them."""
        return any(quant.is_quantized(w) for w in [*self.layers[0], self.head])


@dataclass(slots=True)
class KernelVerdict:
    """What this machine measured of one kernel: time per forward's linears, and invariance."""

    ms_by_rows: dict[int, float] = field(default_factory=dict)  # its best turn at each row count
    invariant: bool | None = None  # None: not tested (only a batch-invariant engine needs it)
    failure: str = ""  # where the self-test first saw a row's bits move
    # Why the turns that timed it could not tell it from the runner-up, when it was chosen so
    # (`_too_close_to_call`); kept in the cache, so a later start that reads it says so.
    doubt: str = ""
    # This start's turns, ms by rows, one dict a turn; none when the figures came from the cache.
    turns_ms: list[dict[int, float]] = field(default_factory=list)

    def record(self, turns_ms: list[dict[int, float]]) -> None:
        self.turns_ms = turns_ms
        self.ms_by_rows = {rows: min(turn[rows] for turn in turns_ms) for rows in turns_ms[0]}

    @property
    def score_ms(self) -> float:
        """Geometric mean over the probed batch sizes: each size counts alike."""
        return _geometric_mean(self.ms_by_rows.values())

    @property
    def spread_ms(self) -> float:
        """How far apart this start's turns were: its slowest turn's score less its fastest's
        (0 for figures from the cache)."""
        scores = [_geometric_mean(turn.values()) for turn in self.turns_ms]
        return max(scores) - min(scores) if scores else 0.0


def _geometric_mean(values: Iterable[float]) -> float:
    logs = [math.log(v) for v in values]
    return math.exp(sum(logs) / len(logs))


@dataclass(frozen=True, slots=True)
class KernelChoice:
    kernel: LinearKernel
    reason: str
    verdicts: dict[str, KernelVerdict]
    batch_invariant: bool  # whether the chosen kernel passed the self-test
    from_cache: bool

    def columns(self) -> dict[str, object]:
        """For bench CSV rows: the kernel and why it was picked."""
        return {"linear_kernel": self.kernel.name, "linear_kernel_reason": self.reason}


class KernelUnavailableError(ValueError):
    """A forced kernel this machine cannot run, or that fails the self-test it was asked to pass;
    or no kernel at all for this dtype here. `option` names the setting to change."""

    def __init__(self, message: str, option: str = "linear_kernel") -> None:
        super().__init__(message)
        self.option = option


def choose_kernel(shape: ProbeShape, *, device: torch.device, max_rows: int, prefill_rows: int,
                  batch_invariant: bool, forced: str | None = None,
                  cache_path: Path | None = None, loop_overhead_ms: float = 0.0,
                  threads: int | None = None) -> KernelChoice:
    """The fastest kernel that qualifies: measured (or read from the cache), never assumed, at
    `threads` threads (the engine's start-up policy's; None: `native.thread_count`'s).
    `loop_overhead_ms`: what a forward through the per-layer loop costs beyond its linears,
    measured by the caller where the model could run the one-call decoder (else 0); it is
    added to the kernels that cannot, so a few percent of linears' noise never trades the
    one-call step away. A verdict this start's turns cannot call (`_too_close_to_call`: a
    busy machine) is cached all the same, with that doubt, so that no later start waits for
    the probe again (a wrong call costs at most the turns' spread); its start-up line says so,
    and removing the cache file measures again."""
    candidates = quantized_kernels_for(device) if shape.quantized else kernels_for(device)
    if forced is not None:
        names = [k.name for k in candidates]
        if forced not in names:
            why = f" ({left_out(device)[forced]})" if forced in left_out(device) else ""
            raise KernelUnavailableError(
                f"{forced!r} is not a linear kernel for {device.type} here{why}; "
                f"choose from {', '.join(names)}")
        candidates = [k for k in candidates if k.name == forced]
    candidates = _runnable(candidates, shape.layers[0][0], forced, threads)
    key = _cache_key(shape, device, max_rows, prefill_rows, native.thread_count(threads))
    cached = _read_cache(cache_path, key)
    verdicts = {k.name: cached.get(k.name) or KernelVerdict() for k in candidates}
    from_cache = all(v.ms_by_rows for v in verdicts.values())
    rows = probe_rows(max_rows, prefill_rows)
    timed = not from_cache
    if timed:  # all of them, in the same turns, so that their figures compare
        if len(candidates) > 1:
            log.info("linear kernel: timing %d candidates on the model's own weights (once per machine, "
                     "threads and model shape: the verdict is cached%s)", len(candidates),
                     f" in {cache_path}" if cache_path is not None else " for no later start")
        for name, turns_ms in time_kernels(candidates, shape.layers, rows, device, threads=threads).items():
            verdicts[name].record(turns_ms)

    def step_ms(kernel: LinearKernel) -> float:
        return verdicts[kernel.name].score_ms + (0.0 if kernel.one_call_decoder else loop_overhead_ms)

    ranked = sorted(candidates, key=step_ms)
    chosen, reason = ranked[0], "fastest"
    if batch_invariant:
        for kernel in ranked:
            verdict = verdicts[kernel.name]
            if verdict.invariant is None:
                from_cache = False
                verdict.failure = self_test(kernel, shape, max_rows=max_rows, prefill_rows=prefill_rows,
                                            threads=threads)
                verdict.invariant = not verdict.failure
            if verdict.invariant:
                chosen, reason = kernel, "fastest batch-invariant"
                break
    invariant = bool(verdicts[chosen.name].invariant)
    if forced is not None:
        if batch_invariant and not invariant:
            raise KernelUnavailableError(
                f"{forced!r} fails the batch-invariance self-test on this machine "
                f"({verdicts[forced].failure}); run with --no-batch-invariant or another kernel")
        reason = "forced"
    elif batch_invariant and not invariant:
        reason = "fastest; no candidate passed the batch-invariance self-test on this machine"
    if timed:
        doubt = _too_close_to_call(chosen, ranked, verdicts, step_ms)
        for name, verdict in verdicts.items():
            verdict.doubt = doubt if name == chosen.name else ""
    if cache_path is not None and not from_cache:
        _write_cache(cache_path, key, verdicts)
    reason += f" ({_timing_summary(chosen, ranked, verdicts)})"
    if loop_overhead_ms and len(candidates) > 1:
        reason += f"; {loop_overhead_ms:.1f} ms a forward added to kernels that run the per-layer loop"
    if doubt := verdicts[chosen.name].doubt:
        reason += f"; measured within noise: {doubt}"
        if cache_path is not None:
            reason += f"; cached all the same (removing {cache_path} measures again)"
    if forced is None and (unusable := left_out(device)):
        reason += "; left out: " + "; ".join(f"{name} ({why})" for name, why in unusable.items())
    return KernelChoice(chosen, reason, verdicts, invariant, from_cache)


def probe_rows(max_rows: int, prefill_rows: int) -> tuple[int, ...]:
    """The row counts the engine calls a linear with that the probe times: decode steps up to
    `max_rows`, and a prompt chunk of `prefill_rows` (capped at PROBE_PREFILL_ROWS)."""
    rows = tuple(r for r in PROBE_ROWS if r <= max_rows) or (1,)
    chunk = min(prefill_rows, PROBE_PREFILL_ROWS)
    return (*rows, chunk) if chunk > rows[-1] else rows


def _runnable(candidates: list[LinearKernel], weight: torch.Tensor, forced: str | None,
              threads: int | None) -> list[LinearKernel]:
    """The candidates that can multiply this dtype on this machine at all (oneDNN refuses
    float16 on CPUs without AVX512-FP16, for one), tried on one real weight."""
    refused = {}
    for kernel in candidates:
        try:
            kernel.apply(torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device),
                         kernel.pack(weight, threads=threads), threads=threads)
        except RuntimeError as error:
            refused[kernel.name] = str(error).splitlines()[0]
    dtype = str(weight.dtype).removeprefix("torch.")
    if forced is not None and forced in refused:
        raise KernelUnavailableError(f"{forced!r} cannot run {dtype} on this machine: {refused[forced]}")
    if len(refused) == len(candidates):
        reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
        raise KernelUnavailableError(f"no linear kernel runs {dtype} on this machine ({reasons})", "dtype")
    return [k for k in candidates if k.name not in refused]


def time_kernels(kernels: list[LinearKernel], layers: list[list[torch.Tensor]], rows: Iterable[int],
                 device: torch.device, *, turns: int = PROBE_TURNS,
                 threads: int | None = None) -> dict[str, list[dict[int, float]]]:
    """Milliseconds for one forward's linears through each kernel at each row count, one figure
    a turn: a turn times every kernel once, in an order rotated every turn (see PROBE_TURNS),
    each on `threads` threads.
    Scaled from enough layers that the weights stream from memory, as they do in a real step."""
    sample = _probe_sample(layers)
    scale = len(layers) / len(sample)
    packed_by_pack: dict[Callable, list[list[torch.Tensor]]] = {}
    for kernel in kernels:  # kernels that pack alike (the x8 pair, the oneDNN pair) share one copy
        if kernel.pack not in packed_by_pack:
            packed_by_pack[kernel.pack] = [[kernel.pack(w, threads=threads) for w in layer]
                                           for layer in sample]
    dtype = layers[0][0].dtype
    turns_ms: dict[str, list[dict[int, float]]] = {k.name: [{} for _ in range(turns)] for k in kernels}
    for count in rows:
        inputs = {w.shape[1]: torch.randn(count, w.shape[1], device=device).to(dtype) for w in layers[0]}
        passes = {k.name: _one_pass(k, packed_by_pack[k.pack], sample, inputs, threads) for k in kernels}
        for run in passes.values():
            run()  # the first call pays for allocation and oneDNN's primitive creation
        for turn in range(turns):
            first = turn % len(kernels)
            for kernel in kernels[first:] + kernels[:first]:
                seconds = _seconds(passes[kernel.name], device)
                turns_ms[kernel.name][turn][count] = round(1e3 * scale * seconds, 3)
    return turns_ms


def _probe_sample(layers: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """The first layers that hold PROBE_MIN_BYTES of weights (all of them, if they hold less)."""
    sample, nbytes = [], 0
    for layer in layers:
        sample.append(layer)
        nbytes += sum(w.nbytes for w in layer)
        if nbytes >= PROBE_MIN_BYTES:
            break
    return sample


def _one_pass(kernel: LinearKernel, packed_sample: list[list[torch.Tensor]], sample: list[list[torch.Tensor]],
              inputs: dict[int, torch.Tensor], threads: int | None) -> Callable[[], None]:
    def run() -> None:
        for packed_layer, layer in zip(packed_sample, sample, strict=True):
            for packed, weight in zip(packed_layer, layer, strict=True):
                kernel.apply(inputs[weight.shape[1]], packed, threads=threads)

    return run


def self_test(kernel: LinearKernel, shape: ProbeShape, *, max_rows: int, prefill_rows: int,
              seed: int = 0, threads: int | None = None) -> str:
    """'' when every row's bits are independent of the call it is in; else where they moved
    (every call on `threads` threads).

    For each distinct weight shape (and the head, which only sees decode-sized calls), its first
    SELF_TEST_COLUMNS output features: rows computed alone are the reference; every call of M
    rows (1..max_rows) at two offsets, and every row of the prefill-sized calls, must reproduce
    them bit for bit.
    """
    generator = torch.Generator().manual_seed(seed)
    offset = 7  # a row's position in the call must not matter either
    distinct = {tuple(w.shape): w for w in shape.layers[0]}
    targets = [(w, prefill_rows) for w in distinct.values()] + [(shape.head, 0)]
    for whole, prefill in targets:
        weight = _leading_columns(whole, SELF_TEST_COLUMNS)
        packed = kernel.pack(weight, threads=threads)
        # Every row of a prefill call, not only its first: later row panels may take another path.
        reference_rows = max(max_rows + offset, prefill)
        x = torch.randn(max(reference_rows, prefill), weight.shape[1], generator=generator)
        x = x.to(device=weight.device, dtype=weight.dtype)
        alone = torch.cat([kernel.apply(x[r : r + 1], packed, threads=threads)
                           for r in range(reference_rows)])
        calls = [(m, start) for m in range(1, max_rows + 1) for start in (0, offset)]
        calls += [(m, 0) for m in sorted({2 * max_rows, prefill}) if m > max_rows and prefill]
        for m, start in calls:
            out = kernel.apply(x[start : start + m], packed, threads=threads)
            checked = min(m, reference_rows - start)
            if not torch.equal(out[:checked], alone[start : start + checked]):
                out_features, in_features = whole.shape
                return (f"{m} rows at offset {start} differ from rows alone, "
                        f"weight {out_features}x{in_features}")
    return ""


def _leading_columns(weight: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` output features of a dense or block weight (a stack of parts whole)."""
    if weight.shape[0] <= count:
        return weight
    if isinstance(weight, quant.QuantizedWeight):
        return weight.rows(torch.arange(count))
    return weight[:count] if isinstance(weight, torch.Tensor) and not quant.is_quantized(weight) else weight


_clock = time.perf_counter  # the probe's clock (a test's fake one stalls on cue)


def _seconds(run: Callable[[], None], device: torch.device) -> float:
    """One timed call of `run`, its queued CUDA work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = _clock()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _clock() - start


def _too_close_to_call(chosen: LinearKernel, ranked: list[LinearKernel], verdicts: dict[str, KernelVerdict],
                       step_ms: Callable[[LinearKernel], float]) -> str:
    """Why this start's turns cannot tell the chosen kernel from the runner-up, or '' when they
    can (or the figures came from the cache). The runner-up is the next kernel in the ranking
    that the same rules could have chosen. They cannot when the runner-up's margin is smaller
    than the spread of either kernel's turns (`KernelVerdict.spread_ms`), and that spread is
    more than a quiet machine's (QUIET_SPREAD): the noise of this measurement could have
    ordered them either way."""
    invariant_only = bool(verdicts[chosen.name].invariant)
    rivals = [k for k in ranked[ranked.index(chosen) + 1:]
              if not invariant_only or verdicts[k.name].invariant is not False]
    if not rivals:
        return ""
    runner_up = rivals[0]
    margin_ms = step_ms(runner_up) - step_ms(chosen)
    spread_ms = max(verdicts[chosen.name].spread_ms, verdicts[runner_up.name].spread_ms)
    if margin_ms >= spread_ms or spread_ms <= QUIET_SPREAD * step_ms(chosen):
        return ""
    return (f"{chosen.name}'s margin over {runner_up.name}, {margin_ms:.1f} ms, is inside the spread "
            f"of their turns, {spread_ms:.1f} ms")


def _timing_summary(chosen: LinearKernel, ranked: list[LinearKernel],
                    verdicts: dict[str, KernelVerdict]) -> str:
    def describe(kernel: LinearKernel) -> str:
        verdict = verdicts[kernel.name]
        times = "/".join(f"{ms:.1f}" for ms in verdict.ms_by_rows.values())
        flag = {True: "", False: ", not invariant", None: ""}[verdict.invariant]
        return f"{kernel.name} {times}{flag}"

    counts = list(verdicts[chosen.name].ms_by_rows)
    rows = "/".join(str(r) for r in counts) + (" row" if counts == [1] else " rows")
    others = [describe(k) for k in ranked if k is not chosen]
    return f"ms per forward's linears at {rows}: {describe(chosen)}" + (
        f"; {'; '.join(others)}" if others else "")


def _cache_key(shape: ProbeShape, device: torch.device, max_rows: int, prefill_rows: int,
               threads: int) -> str:
    weight = shape.layers[0][0]
    facts = {
        "version": CACHE_VERSION,
        "cpu": cpu_model(), "flags": vector_flags(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": threads, "dtype": str(weight.dtype),
        "native": _native_build_key(),
        **({"formats": [quant.format_names(w) for w in [*shape.layers[0], shape.head]]}
           if shape.quantized else {}),
        "shapes": [list(w.shape) for w in shape.layers[0]] + [list(shape.head.shape)],
        "layers": len(shape.layers), "max_rows": max_rows, "prefill_rows": prefill_rows,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def _native_build_key() -> str:
    """The native library's build (its sources' hash), so an edited kernel is measured again."""
    library = native.library()
    return library.build.path.parent.name if library is not None and library.build.path else "off"


def _read_cache(path: Path | None, key: str) -> dict[str, KernelVerdict]:
    if path is None or not path.is_file():
        return {}
    try:
        entry = json.loads(path.read_text(encoding="utf-8")).get(key, {})
        return {name: KernelVerdict({int(r): ms for r, ms in v["ms_by_rows"].items()}, v["invariant"],
                                    v["failure"], v.get("doubt", "")) for name, v in entry.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        log.warning("ignoring an unreadable kernel cache at %s", path)
        return {}


def _write_cache(path: Path, key: str, verdicts: dict[str, KernelVerdict]) -> None:
    """The verdicts under `key`, beside those of other keys."""
    try:
        everything = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        everything = {}
    entry = everything.setdefault(key, {})
    entry.update({name: {"ms_by_rows": v.ms_by_rows, "invariant": v.invariant, "failure": v.failure,
                         "doubt": v.doubt} for name, v in verdicts.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(everything, indent=1), encoding="utf-8")
    partial.replace(path)  # atomic: two engines starting at once never read half a file
