"""Building the native kernel library for this machine, once, and finding it again.

Owns: compiling every C file under `csrc/`, its subfolders too, into one shared library with
the system C compiler (`$CC`, else `cc`), for this CPU (-march=native; the wide tiles in
csrc/arch/ select their own ISA, and isa.c picks one at run time), cached under
`cache_root()/native/<key>/`, where the key hashes the sources, the compiler's version, the
flags and the CPU's flags; so a second start compiles nothing, and an edited kernel, a new
compiler or another CPU builds anew.
A build is written beside its final name and renamed into place, so two processes starting
at once never load half a file.
Refuses: to be required. No compiler, a failed build or NANOSERVE_NO_NATIVE=1 give `None`
with the reason, and the engine runs its torch kernels.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from nanoserve.machine import cache_root, cpu_flags

SOURCE_DIR = Path(__file__).with_name("csrc")
LIBRARY_NAME = "libnanoserve.so"
CFLAGS = ("-O3", "-march=native", "-pthread", "-fPIC", "-shared", "-std=gnu11",
          "-fvisibility=hidden", "-Wall")
# A broken compiler must not hang start-up; a clean build takes a few seconds.
COMPILE_TIMEOUT_S = 120


@dataclass(frozen=True, slots=True)
class BuildResult:
    """The library's path, or None and why; `compile_s` is 0.0 when the cache had it."""

    path: Path | None
    reason: str
    compile_s: float = 0.0


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def build_key(sources: list[Path], cc: str, source_dir: Path = SOURCE_DIR) -> str:
    digest = hashlib.sha256()
    for source in sources:
        name = source.relative_to(source_dir).as_posix() if source.is_relative_to(source_dir) else source.name
        digest.update(name.encode() + b"\0" + source.read_bytes() + b"\0")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    facts = [version.splitlines()[0] if version else cc, *CFLAGS, platform.machine(), *sorted(cpu_flags())]
    digest.update("\0".join(facts).encode())
    return digest.hexdigest()[:16]


def build_library(source_dir: Path = SOURCE_DIR, cache_dir: Path | None = None) -> BuildResult:
    """The built library for these sources on this machine, compiling it if no cache has it."""
    cc = compiler()
    if cc is None:
        return BuildResult(None, f"no C compiler ({os.environ.get('CC', 'cc')!r} not found; set CC)")
    sources = sorted(source_dir.rglob("*.c"))
    headers = sorted(source_dir.rglob("*.h"))
    try:
        key = build_key(sources + headers, cc, source_dir)
    except (OSError, subprocess.SubprocessError) as error:
        return BuildResult(None, f"cannot run the C compiler {cc}: {error}")
    target = (cache_dir or cache_root() / "native") / key / LIBRARY_NAME
    if target.is_file():
        return BuildResult(target, f"cached build {key}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{LIBRARY_NAME}.{os.getpid()}.tmp")
    command = [cc, *CFLAGS, f"-I{source_dir}", "-o", str(partial), *map(str, sources), "-lm"]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        return BuildResult(None, f"the C compiler failed to run: {error}")
    compile_s = time.perf_counter() - start
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        first_error = next((line for line in done.stderr.splitlines() if "error" in line),
                           done.stderr.strip()[:200])
        return BuildResult(None, f"the native build failed: {first_error}")
    partial.replace(target)
    return BuildResult(target, f"compiled {key} in {compile_s:.1f} s", compile_s)
