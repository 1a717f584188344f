"""How long torch's OpenMP workers spin after an op: briefly, so the native pool gets the cores.

On the native path a step is one native call on the library's own thread pool plus a few small
torch ops (embedding, argmax, sampling). libgomp's workers, by default, spin for hundreds of
thousands of iterations after each torch op before they sleep; the native pool's workers then
share their cores with spinning OpenMP threads, and every barrier of the native call waits for
the OS to switch them (`results/README.md`, "torch's OpenMP spin"). A spin of about the native
pool's own (csrc/runtime/threadpool.c, NS_POOL_SPIN_US) still bridges back-to-back torch ops.

libgomp reads its settings once, when torch loads it, so this must run before the first
`import torch` of the process: `nanoserve/__init__.py` calls `configure()` first thing. A user's
own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept. Torch-free.
"""

from __future__ import annotations

import os
import sys

SPIN_VARIABLE = "GOMP_SPINCOUNT"
POLICY_VARIABLE = "OMP_WAIT_POLICY"
SPIN_COUNT = "10000"

_configured = False
_set_here = False  # whether SPIN_VARIABLE is ours (not the user's)


def configure() -> None:
    """Shorten libgomp's spin, where torch is not loaded yet and the user has not chosen."""
    global _configured, _set_here
    if SPIN_VARIABLE in os.environ or POLICY_VARIABLE in os.environ:
        _configured = True
    elif "torch" not in sys.modules:
        os.environ[SPIN_VARIABLE] = SPIN_COUNT
        _configured = _set_here = True


def foreign_environment() -> dict[str, str]:
    """The environment for another program's process (llama.cpp beside us in a benchmark): without
    our spin setting, which suits our pool and would slow an OpenMP program's own barriers."""
    environment = dict(os.environ)
    if _set_here:
        environment.pop(SPIN_VARIABLE, None)
    return environment


def note() -> str | None:
    """A start-up note where torch was loaded before nanoserve, with libgomp's default spin."""
    if _configured:
        return None
    return (f"torch was imported before nanoserve, so its OpenMP workers spin at libgomp's default and "
            f"slow the native kernels; set {SPIN_VARIABLE}={SPIN_COUNT} (or import nanoserve first)")
