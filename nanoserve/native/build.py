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
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nanoserve.machine import cache_root, cpu_flags

SOURCE_DIR = Path(__file__).with_name("csrc")
LIBRARY_NAME = "libnanoserve.so"
CFLAGS = ("-O3", "-march=native", "-pthread", "-fPIC", "-shared", "-std=gnu11",
          "-fvisibility=hidden", "-Wall")
COMPILE_FLAGS = tuple(flag for flag in CFLAGS if flag != "-shared")  # each source to an object
# A broken compiler must not hang start-up; a source compiles in seconds on an idle core.
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
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as objects:
        failure = _compile_and_link(cc, source_dir, sources, Path(objects), partial)
    compile_s = time.perf_counter() - start
    if failure:
        partial.unlink(missing_ok=True)
        return BuildResult(None, failure)
    partial.replace(target)
    return BuildResult(target, f"compiled {key} in {compile_s:.1f} s", compile_s)


def _compile_and_link(cc: str, source_dir: Path, sources: list[Path], objects: Path, out: Path) -> str:
    """Each source compiled on its own, as many at once as the machine has cores (the wide tiles
    take most of a build), then linked into `out`; '' or what failed."""
    def compile_one(index_source: tuple[int, Path]) -> subprocess.CompletedProcess | str:
        index, source = index_source
        command = [cc, *COMPILE_FLAGS, f"-I{source_dir}", "-c", str(source), "-o",
                   str(objects / f"{index}.o")]
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as error:
            return f"the C compiler failed to run: {error}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(compile_one, enumerate(sources)))
    link = [cc, *CFLAGS, "-o", str(out), *(str(objects / f"{i}.o") for i in range(len(sources))), "-lm"]
    for result in results:
        if isinstance(result, str):
            return result
        if result.returncode != 0:
            return f"the native build failed: {_first_error(result.stderr)}"
    try:
        done = subprocess.run(link, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        return f"the C compiler failed to run: {error}"
    return "" if done.returncode == 0 else f"the native build failed: {_first_error(done.stderr)}"


def _first_error(stderr: str) -> str:
    return next((line for line in stderr.splitlines() if "error" in line), stderr.strip()[:200])
