"""Transparent huge pages under the packed weights, the tensor every decode step streams.

A one-slot decode step reads every weight once: a memory-bound stream. On 4 KiB pages each 2 MiB
of such a stream is 512 TLB entries and page walks; on one 2 MiB page it is one
(results/huge_pages_*.csv have what that does to a streaming matrix-vector product and a decode
step here). Linux leaves huge pages to a process that asks
(THP "madvise", the common default), so:
- the packed weights are gathered into one arena as the model packs them (`gather`): a matrix
  smaller than 2 MiB (a small model's every layer) shares huge pages with its neighbours instead
  of sitting on small pages of its own, and the arena starts on a 2 MiB boundary;
- the weights, written at load, are marked (MADV_HUGEPAGE) and moved onto huge pages now
  (MADV_COLLAPSE, Linux 6.1+): a copy of each tensor's whole 2 MiB runs, once;
- the KV cache is left on small pages. It is a lazy anonymous mapping (`kv_cache.zero_filled`)
  laid out head by head ([kv heads, blocks, block size, head dim] a layer's K or V), so one
  prompt's blocks write a little of every head's region: marked, each of those writes took a
  whole 2 MiB page, and the first 512-token prompt at the 1.7B shape made about 3 GB resident
  and prefilled at half speed, zeroing it (results/kv_cache_small_pages.csv). On small pages the
  cache holds what requests wrote, to the nearest 4 KiB of each head's region.
Where the system refuses (another OS, THP "never", a kernel before 6.1, a file-backed mapping),
pages stay as they were: the bits computed never depend on it, only the speed.
NANOSERVE_HUGE_PAGES=0 leaves every page as the allocator made it (the A/B of
`nanoserve.bench.experiments.huge_pages`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
import sys
from collections.abc import Iterable, Iterator

import torch

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # of each tensor in the arena: a cache line, what the allocator gives
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    libc = _libc()
    if libc is None:
        return None
    madvise = libc.madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc keeps freed tensors of a few MB in
    its heap, so the storages `gather` left would count in the process's memory until reused)."""
    trim = getattr(_libc(), "malloc_trim", None)  # glibc's; musl and others have none
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)


def enabled() -> bool:
    return os.environ.get("NANOSERVE_HUGE_PAGES", "1") != "0"


def _in_cpu_storage(t: torch.Tensor) -> bool:
    """Whether `t`'s bytes lie in a CPU storage of its own kind (oneDNN's buffers have none)."""
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn


def _huge_runs(t: torch.Tensor) -> tuple[int, int] | None:
    """The whole 2 MiB runs inside `t`'s storage: (start address, bytes), or None."""
    if not _in_cpu_storage(t):
        return None
    storage = t.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    return (first, last - first) if last > first else None


def _movable(t: torch.Tensor) -> bool:
    """A tensor that owns its storage outright (no view of a larger one, no oneDNN buffer), on
    the CPU: moving its bytes elsewhere moves all of it."""
    return (_in_cpu_storage(t) and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.nbytes)


def gather(tensors: Iterable[torch.Tensor], *, keep: Iterable[torch.Tensor] = ()) -> int:
    """Move every tensor that owns its storage into one arena that starts on a 2 MiB boundary,
    in place (`Tensor.set_`: whoever holds the tensor sees the new bytes, the old storage is
    freed). `advise` then moves the arena onto huge pages as it does any weight: marked before
    the copy instead, each first write would wait for the kernel to compact a huge page. Tensors
    sharing storage with one in `keep` (what a caller still holds: moving it would keep two
    copies) stay put. Call it before anything takes the tensors' addresses. Returns the bytes
    gathered."""
    if not enabled():
        return 0
    kept = {t.untyped_storage().data_ptr() for t in keep if _in_cpu_storage(t)}
    moving: list[torch.Tensor] = []
    for t in tensors:
        if _movable(t) and t.untyped_storage().data_ptr() not in kept:
            kept.add(t.untyped_storage().data_ptr())  # a tensor met twice moves once
            moving.append(t)
    offsets, total = [], 0
    for t in moving:
        offsets.append(total)
        total += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
    if total < HUGE_PAGE:  # nothing to share a huge page with: leave the allocator's pages
        return 0
    arena = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = -arena.data_ptr() % HUGE_PAGE
    with torch.inference_mode():
        for t, offset in zip(moving, offsets, strict=True):
            at = start + offset
            arena[at: at + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
            t.set_(arena.untyped_storage(), at // t.element_size(), t.shape, t.stride())
    _return_freed_memory()
    return total


def advise(tensors: Iterable[torch.Tensor]) -> int:
    """Mark each tensor's whole 2 MiB runs for huge pages and move the pages already written
    onto them now. Returns the bytes now on huge pages; 0 where the system refuses."""
    madvise = _madvise()
    if madvise is None or not enabled():
        return 0
    done, seen = 0, set()
    for t in tensors:
        runs = _huge_runs(t)
        if runs is None or runs[0] in seen:
            continue
        seen.add(runs[0])
        if madvise(runs[0], runs[1], MADV_HUGEPAGE) != 0:
            continue
        if madvise(runs[0], runs[1], MADV_COLLAPSE) != 0:
            continue
        done += runs[1]
    return done


def note(moved: int, weights_nbytes: int) -> str:
    """The start-up line: the weights' bytes `advise` moved onto huge pages (a tensor's ends short
    of a whole 2 MiB run stay on small pages)."""
    if not enabled():
        return "huge pages: off (NANOSERVE_HUGE_PAGES=0)"
    if not moved:
        return "huge pages: none (no weight holds a whole 2 MiB run, or the system refused them)"
    # the arena's whole runs reach past its last weight: at most all of them are on huge pages
    on_huge_pages = min(moved, weights_nbytes)
    return f"huge pages: {on_huge_pages / 1e6:.1f} of {weights_nbytes / 1e6:.1f} MB of weights"


def tensors_in(value: object) -> Iterator[torch.Tensor]:
    """Every tensor a weights object holds: through dataclass fields, lists and tuples (the
    packed layouts of `nanoserve.model.linear` are all of these)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_in(getattr(value, f.name))
