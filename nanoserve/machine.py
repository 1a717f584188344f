"""Facts about the machine this process runs on, for every floor above it.

Owns: the CPU's model name and instruction-set flags (read from /proc/cpuinfo), and where
nanoserve keeps its per-machine caches (converted models, kernel verdicts, built native
kernels). The kernel choice, the native build and the bench all key their caches or label
their results by these, so they live below all three: the core never imports the bench.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# The extensions that decide which matrix kernels are fast here (and key the kernel caches).
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx_vnni", "amx_bf16", "amx_int8", "asimd", "sve")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """Every flag the CPU reports (x86 `flags`, ARM `Features`)."""
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def vector_flags() -> list[str]:
    flags = cpu_flags()
    return [flag for flag in VECTOR_FLAGS if flag in flags]


def cache_root() -> Path:
    """$NANOSERVE_CACHE, else $XDG_CACHE_HOME/nanoserve, else ~/.cache/nanoserve."""
    if explicit := os.environ.get("NANOSERVE_CACHE"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "nanoserve"
