"""The shared-memory exchange of tensor-parallel ranks in C (csrc/runtime/collective.c): write this
rank's slot, publish its counter, spin for the others, and sum the slots in rank order.

Owns: the ctypes signatures of that exchange. distributed/shared_memory.py owns the buffer, its
layout, and the wait that sleeps and asks whether a rank died; it calls this where the library
is loaded and runs its own Python exchange where not (the same bits: the sum is elementwise in
rank order either way).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from nanoserve import native

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# How long the C call spins for the other ranks before handing the wait back to Python, which
# sleeps: about what a rank's share of a layer takes, so a step's exchanges never sleep.
SPIN_US = 2000


@dataclass(frozen=True, slots=True)
class NativeExchange:
    publish: ctypes._CFuncPtr  # write, publish, spin: 0 when every rank arrived, 1 when the spin ran out
    sum_slots: ctypes._CFuncPtr  # the float32 slots summed in rank order
    all_reduce: ctypes._CFuncPtr  # publish, then the sum when every rank arrived within the spin


def load() -> NativeExchange | None:
    """The exchange of this machine's library, or None where it is off (`native.status()` says why)."""
    library = native.library()
    if library is None:
        return None
    publish = library.lib.ns_shm_publish
    publish.argtypes = (_P, _I64, _INT, _INT, _I64, _P, _I64, _P, _I64, _I64)
    publish.restype = _INT
    sum_slots = library.lib.ns_shm_sum
    sum_slots.argtypes = (_P, _I64, _INT, _I64, _P)
    sum_slots.restype = None
    all_reduce = library.lib.ns_shm_all_reduce
    all_reduce.argtypes = (_P, _I64, _INT, _INT, _I64, _P, _I64, _P, _I64, _P, _I64)
    all_reduce.restype = _INT
    return NativeExchange(publish, sum_slots, all_reduce)
