"""The machine a measurement ran on, and what its memory and arithmetic can reach.

Owns: a description of the machine (CPU model, cores, torch version and threads, device),
the git commit of the code measured, a read-bandwidth probe (the best of a few streaming
reads over 512 MB: a sum, a dot product and a matrix-vector product, since on some CPUs one
of them is itself a slow kernel and would understate the memory), a GEMM FLOP/s probe that
runs the linear kernel the engine runs, a peak probe of the cores' own int8 dot-product and
float32 FMA rates on the widest ISA the native tiles run (`compute_peak`), and per-config
peak memory.
Each probe runs for about a second, so it can run beside the measurement it calibrates.
Refuses: quoting figures from elsewhere; every limit here is measured in the same process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from nanoserve import native
from nanoserve.machine import cpu_model, vector_flags
from nanoserve.model.linear import KERNELS, LinearKernel

REPO_ROOT = Path(__file__).resolve().parents[2]
# The shape of the GEMM probe: SmolLM2-135M's hidden size against a wide stacked weight.
GEMM_IN_FEATURES, GEMM_OUT_FEATURES = 576, 12288


@dataclass(frozen=True, slots=True)
class Machine:
    """Where a run happened, as columns every results row carries."""

    cpu_model: str
    cpu_flags: str  # the vector extensions that decide GEMM speed (avx512, amx...)
    cores: int
    threads: int
    memory_gib: float
    torch_version: str
    device: str
    device_name: str
    git_commit: str
    timestamp: str

    def columns(self) -> dict[str, object]:
        return asdict(self)

    @property
    def label(self) -> str:
        """One line naming the machine, for chart titles and terminal headers."""
        where = self.device_name if self.device != "cpu" else self.cpu_model
        return f"{where}, {self.cores} cores, {self.threads} threads, torch {self.torch_version}"


def describe_machine(device: torch.device | str = "cpu") -> Machine:
    device = torch.device(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return Machine(
        cpu_model=cpu_model(),
        cpu_flags=" ".join(vector_flags()),
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        threads=native.thread_count(None),
        memory_gib=round(total_memory_bytes() / 2**30, 1),
        torch_version=torch.__version__,
        device=str(device),
        device_name=device_name,
        git_commit=git_commit(),
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def total_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def git_commit() -> str:
    """The commit measured, with '+dirty' when the working tree differs from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(run: Callable[[], object], device: torch.device, *, budget_s: float = 1.0,
                 min_trials: int = 3) -> float:
    """Shortest wall time of `run` over about `budget_s`: the least disturbed trial on a shared box."""
    run()  # the first call pays for allocation and kernel selection
    _synchronize(device)
    best = float("inf")
    trials = 0
    deadline = time.perf_counter() + budget_s
    while trials < min_trials or time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
        trials += 1
    return best


def streaming_reads(matrix: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Ways to read every byte of `matrix` once; which is fastest depends on the CPU."""
    flat = matrix.view(-1)
    vector = torch.ones(matrix.shape[1], device=matrix.device, dtype=matrix.dtype)
    return {"sum": flat.sum, "dot": lambda: torch.dot(flat, flat), "mv": lambda: torch.mv(matrix, vector)}


def read_bandwidth_gbs(device: torch.device | str = "cpu", *, nbytes: int = 512 << 20,
                       dtype: torch.dtype = torch.float32, budget_s: float = 1.0) -> float:
    """GB/s (1e9 bytes) of the fastest streaming read: the bound of a decode step."""
    device = torch.device(device)
    cols = 4096
    element = torch.tensor([], dtype=dtype).element_size()
    rows = max(1, nbytes // (cols * element))
    matrix = torch.randn(rows, cols, device=device).to(dtype)
    reads = streaming_reads(matrix)
    seconds = min(best_seconds(read, device, budget_s=budget_s / len(reads)) for read in reads.values())
    return matrix.numel() * element / seconds / 1e9


def gemm_gflops(rows: int, device: torch.device | str = "cpu", *, dtype: torch.dtype = torch.float32,
                kernel: LinearKernel | None = None, budget_s: float = 0.5) -> float:
    """GFLOP/s of the engine's linear kernel (default: F.linear), `rows` activations against a
    576 x 12288 weight."""
    device = torch.device(device)
    kernel = kernel or KERNELS["aten"]
    weight = kernel.pack(torch.randn(GEMM_OUT_FEATURES, GEMM_IN_FEATURES, device=device).to(dtype))
    x = torch.randn(rows, GEMM_IN_FEATURES, device=device).to(dtype)
    seconds = best_seconds(lambda: kernel.apply(x, weight), device, budget_s=budget_s)
    return 2.0 * rows * GEMM_IN_FEATURES * GEMM_OUT_FEATURES / seconds / 1e9


@dataclass(frozen=True, slots=True)
class ComputePeak:
    """What the cores retire a second with every lane busy and no memory touched (csrc/arch/x86/
    peak.c): int8 multiply-adds (the quantized tiles' vpdpbusd, or maddubs + madd) and float32
    FMAs, on `isa`, across `threads` threads; operations count a multiply and an add each."""

    isa: str
    threads: int
    int8_gops: float
    f32_gflops: float

    def columns(self) -> dict[str, object]:
        return {"peak_isa": self.isa, "measured_int8_peak_gops": round(self.int8_gops, 1),
                "measured_f32_peak_gflops": round(self.f32_gflops, 1)}


# Rounds of a peak probe call: a few milliseconds of one core's chains
PEAK_ROUNDS = 200_000


def compute_peak(threads: int | None = None, *, budget_s: float = 0.3) -> ComputePeak | None:
    """The peak probe on the ISA the native tiles run here, best of about `budget_s` per rate;
    None with the native library off or no vector ISA."""
    library = native.library()
    if library is None or library.tiles_isa == "portable":
        return None
    threads = native.thread_count(threads)
    probe = library.lib.ns_peak_ops
    probe.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    probe.restype = ctypes.c_int64
    isa = native.ISAS.index(library.tiles_isa)

    def rate(float32: int) -> float:
        ops = probe(isa, float32, PEAK_ROUNDS, threads)
        seconds = best_seconds(lambda: probe(isa, float32, PEAK_ROUNDS, threads), torch.device("cpu"),
                               budget_s=budget_s / 2)
        return ops / seconds / 1e9

    return ComputePeak(library.tiles_isa, threads, rate(0), rate(1))


@dataclass(frozen=True, slots=True)
class HardwareLimits:
    """What this machine reached in the probes, for reading a measurement against its roofline."""

    read_gbs: float  # the fastest float32 streaming read
    peak_gflops: float  # GEMM at 512 rows in the measured dtype
    gflops_by_rows: dict[int, float]  # GEMM at each batch size a sweep runs

    def columns(self) -> dict[str, object]:
        return {"measured_read_gbs": round(self.read_gbs, 2),
                "measured_peak_gflops": round(self.peak_gflops, 1)}

    def decode_roofline_step_s(self, *, weight_bytes: float, flops_per_step: float) -> float:
        """Least time a decode step can take: streaming the weights once, or the arithmetic."""
        return max(weight_bytes / (self.read_gbs * 1e9), flops_per_step / (self.peak_gflops * 1e9))


def probe_limits(device: torch.device | str = "cpu", *, dtype: torch.dtype = torch.float32,
                 rows: tuple[int, ...] = (), kernel: LinearKernel | None = None) -> HardwareLimits:
    """Measure bandwidth and GEMM throughput now, in this process (a few seconds in all)."""
    return HardwareLimits(
        read_gbs=read_bandwidth_gbs(device),
        peak_gflops=gemm_gflops(512, device, dtype=dtype, kernel=kernel),
        gflops_by_rows={r: gemm_gflops(r, device, dtype=dtype, kernel=kernel, budget_s=0.25) for r in rows},
    )


class PeakMemory:
    """Peak memory of the process over a stretch of work: resident set on CPU, allocated on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        # Writing 5 to clear_refs resets VmHWM (Linux >= 4.0); without it the peak is the process's.
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")

    def peak_mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
