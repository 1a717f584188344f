"""Native CPU kernels: the hot loops in C, built for this machine, loaded through ctypes.

Owns: loading the library `build` produced (once per process), checking its ABI version,
and the one line the engine prints at start-up saying whether native kernels run and why.
The kernels take raw pointers to contiguous tensors (`tensor.data_ptr()`), so nothing here
builds against torch's headers; they run on the library's own thread pool (csrc/runtime/threadpool.c),
whose workers stay awake between the calls of a step.
Every kernel call takes its thread count from its caller: the engine passes its start-up
policy's (`nanoserve.worker.startup`, `Startup.threads`), and `thread_count` is the one place a
caller without a policy (a test, a benchmark, library use) gets torch's setting instead.
Refuses: to be required. `library()` is None where there is no compiler, the build failed,
or NANOSERVE_NO_NATIVE=1; callers then take the torch path, which always works.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from nanoserve import openmp
from nanoserve.native.build import BuildResult, build_library

log = logging.getLogger("nanoserve")
T = TypeVar("T")

ABI_VERSION = 4  # csrc/nanoserve.h's NS_ABI_VERSION
DISABLE_VARIABLE = "NANOSERVE_NO_NATIVE"


# csrc/runtime/isa.h's ISAs, in its order: the wide block tiles run on the last one that runs here
# (AVX-512 without VNNI only when NANOSERVE_ISA names it)
ISAS = ("portable", "avx2", "avxvnni", "avx512", "avx512vnni")
ISA_VARIABLE = "NANOSERVE_ISA"  # holds the block tiles to a narrower ISA (to compare them)
# The layouts with a wide tile (csrc/arch/x86/wide_tiles.h); the others run the AVX2 tiles.
WIDE_TILE_FORMATS = "q4_0 q4_1 q8_0 q4_k q6_k"


@dataclass(frozen=True, slots=True)
class NativeLibrary:
    lib: ctypes.CDLL
    isa: str  # the vector path compiled in for every kernel: avx2 or portable
    tiles_isa: str  # the ISA the block tiles run on, chosen at run time (one of ISAS)
    build: BuildResult

    def isas(self) -> list[str]:
        """The ISAs this library runs on this CPU, narrowest first."""
        return [name for number, name in enumerate(ISAS) if self.lib.ns_isa_available(number)]


def thread_count(threads: int | None) -> int:
    """The threads a native call runs on: `threads`, or for a caller with no start-up policy
    (None) torch's intra-op setting, which the engine's start-up sizes to the same count."""
    return torch.get_num_threads() if threads is None else threads


def disabled() -> bool:
    return os.environ.get(DISABLE_VARIABLE, "").strip() not in ("", "0")


@functools.cache
def _load() -> tuple[NativeLibrary | None, str]:
    if disabled():
        return None, f"{DISABLE_VARIABLE}=1"
    build = build_library()
    if build.path is None:
        return None, build.reason
    try:
        lib = ctypes.CDLL(str(build.path))
    except OSError as error:
        return None, f"cannot load {build.path}: {error}"
    lib.ns_abi_version.restype = ctypes.c_int
    lib.ns_isa.restype = ctypes.c_char_p
    lib.ns_native_calls.restype = ctypes.c_uint64
    if lib.ns_abi_version() != ABI_VERSION:
        return None, f"{build.path} has ABI {lib.ns_abi_version()}, expected {ABI_VERSION}"
    lib.ns_isa_available.argtypes = lib.ns_isa_choose.argtypes = [ctypes.c_int]
    lib.ns_isa_available.restype = lib.ns_isa_chosen.restype = lib.ns_isa_choose.restype = ctypes.c_int
    return NativeLibrary(lib, lib.ns_isa().decode(), ISAS[lib.ns_isa_chosen()], build), build.reason


def library() -> NativeLibrary | None:
    """The loaded library, or None (the reason is in `status()`)."""
    return _load()[0]


def bound(cache: list, bind: Callable[[ctypes.CDLL], T]) -> T | None:
    """`bind(lib)`'s result for the loaded library, made once per library (`cache` holds the
    library it was made for and the result: a reloaded library, as the tests make, is bound
    again); None when the library is off."""
    native = library()
    if native is None:
        return None
    if not cache or cache[0][0] is not native:
        cache[:] = [(native, bind(native.lib))]
    return cache[0][1]


def choose_tiles_isa(name: str) -> str:
    """For a benchmark comparing ISAs in one process, between steps: the block tiles run on ISA
    `name` (one of `isas()`) from the next call on; returns the one they ran on. The start-up
    line keeps naming the ISA chosen at load."""
    native = library()
    if native is None:
        raise RuntimeError(status())
    previous = ISAS[native.lib.ns_isa_chosen()]
    if name not in ISAS or native.lib.ns_isa_choose(ISAS.index(name)) != 0:
        raise ValueError(f"isa: {name!r} does not run here (this CPU runs {', '.join(native.isas())})")
    return previous


def calls() -> int:
    """Native kernel calls made so far in this process (0 with the library off); the profile's
    calls per step are differences of it."""
    native = library()
    return 0 if native is None else native.lib.ns_native_calls()


def status() -> str:
    """One line for start-up: which kernels run, and why."""
    native, reason = _load()
    if native is None:
        return f"native kernels: off ({reason}); running torch kernels"
    spin = openmp.note()
    return (f"native kernels: on ({native.isa}; {_tiles_note(native)}; float panels on "
            f"{float_panels_isa(native)}; attention on "
            f"{_attention_isa(native)}; {reason})" + (f"; {spin}" if spin else ""))


# nanoserve.h's NS_ATTN_*: the attention kernel's paths, as the bits ns_attention_isas returns.
ATTENTION_ISAS = {"portable": 1, "avx2": 2, "avx512": 4}


def attention_isas(available: int) -> list[str]:
    """The names of the attention paths in `available` (ns_attention_isas' bits), narrowest first."""
    return [name for name, bit in ATTENTION_ISAS.items() if available & bit]


def _attention_isa(native: NativeLibrary) -> str:
    """The path csrc/stages/attention.c runs here: the widest this CPU runs (it asks cpuid itself)."""
    native.lib.ns_attention_isas.restype = ctypes.c_int
    return attention_isas(native.lib.ns_attention_isas())[-1]


def float_panels_isa(native: NativeLibrary) -> str:
    """The ISA csrc/gemm/matmul_float.c's panels run on here (they follow the block tiles' choice)."""
    native.lib.ns_matmul_float_isa_chosen.restype = ctypes.c_int
    return ISAS[native.lib.ns_matmul_float_isa_chosen()]


def _tiles_note(native: NativeLibrary) -> str:
    """Which ISA the block tiles run on, and why where NANOSERVE_ISA asked for another."""
    note = f"{WIDE_TILE_FORMATS} tiles on {native.tiles_isa}"
    forced = os.environ.get(ISA_VARIABLE, "").strip()
    if forced and forced != native.tiles_isa:
        runs = native.isas()
        why = "unknown" if forced not in ISAS else "not on this CPU"
        note += f" ({ISA_VARIABLE}={forced} {why}; this CPU runs {', '.join(runs)})"
    return note


def raise_for_status(status: int, kernel: str, weight: str, rows: int) -> None:
    """A block kernel's status as the error it means: -2 no memory for the activation blocks,
    -3 a row id outside [0, rows), anything else but 0 the kernel refusing `weight`."""
    if status == -2:
        raise MemoryError(f"the {kernel} could not allocate its activation blocks")
    if status == -3:
        raise IndexError(f"row ids must lie in [0, {rows})")
    if status != 0:
        raise ValueError(f"the native library refused {weight} (status {status})")
