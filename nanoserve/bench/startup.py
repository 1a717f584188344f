"""Time to ready: from `nanoserve serve` starting to its `/health` answering 200, phase by phase.

Owns: the starts (each `nanoserve serve` a fresh process on a free loopback port, polled every
POLL_S until `/health` says 200, then stopped), the engine's own phases read from its start-up
line (`StartupPhases.summary`: native kernels, model files, tokenizer, weights, kernel choice,
model, KV cache, ...), what came before the engine (the interpreter, imports, the command line,
uvicorn) as the time to ready less the engine's, the median of each over the turns, and a CSV
with the machine, the load average and whether it was quiet in every row.
Two cache states, as a user meets them:
- warm: the per-machine caches (`~/.cache/nanoserve`: the model's config and tokenizer, the
  kernel verdicts, the native build) filled by one untimed start first, as every start after a
  machine's first finds them;
- cold: an empty cache directory per start with only the native build linked in (the C
  compiler's minute is a one-off of installing, not of starting), as a machine's first start
  of a model finds it: the GGUF metadata read and the kernel probe run.
The GGUF file itself stays in the OS page cache either way, as it is after any earlier read.
Refuses: asserting a figure; a busy machine's figures are written, marked `busy` (the 1-minute
load average above LOAD_QUIET per core), for a quiet window to measure again.

    python -m nanoserve.bench.startup --model ~/.cache/nanoserve-anchors/shapes/shape-1.7b-q4_k_m.gguf \
        --turns 3 --caches warm,cold --out results/startup_1.7b.csv
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from nanoserve.bench.hardware import describe_machine
from nanoserve.bench.serve import free_port, stop_server
from nanoserve.machine import cache_root

POLL_S = 0.05
READY_TIMEOUT_S = 600.0
# A machine is quiet while its 1-minute load average stays under this per core.
LOAD_QUIET = 0.25
CACHES = ("warm", "cold")
_PHASE = re.compile(r"(?:^|, )([^,()]+?) (\d+\.\d+) s")


def parse_phases(line: str) -> dict[str, float]:
    """The engine's phases from its start-up line (`StartupPhases.summary`), seconds by name;
    {} when `line` is not that line."""
    _, found, rest = line.partition("start-up: ")
    if not found:
        return {}
    inside = rest[rest.find("(") + 1 : rest.rfind(")")]
    return {name: float(seconds) for name, seconds in _PHASE.findall(inside)}


def one_start(model: str, extra: list[str], env: dict[str, str]) -> dict[str, float]:
    """One `nanoserve serve` from spawn to `/health` 200: the seconds to ready, the engine's
    phases and its total, and what came before the engine. Raises RuntimeError if it exits
    or is not ready within READY_TIMEOUT_S."""
    port = free_port()
    command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *extra]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready_s = _wait_healthy(f"http://127.0.0.1:{port}/health", process, start)
        finally:
            stop_server(process)
        log.seek(0)
        output = log.read()
    if ready_s is None:
        raise RuntimeError(f"the server did not become ready: {output[-2000:]}")
    phases = next((p for p in map(parse_phases, output.splitlines()) if p), {})
    if not phases:  # an engine that prints no start-up line (code before it): the total alone
        return {"ready_s": ready_s}
    engine_s = sum(phases.values())
    return {"ready_s": ready_s, "engine_s": engine_s, "before_engine_s": ready_s - engine_s,
            **{f"{name.replace(' ', '_')}_s": seconds for name, seconds in phases.items()}}


def _wait_healthy(url: str, process: subprocess.Popen, start: float) -> float | None:
    while time.perf_counter() - start < READY_TIMEOUT_S and process.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=1).status_code == 200:
                return time.perf_counter() - start
        time.sleep(POLL_S)
    return None


def cold_cache() -> tempfile.TemporaryDirectory:
    """An empty cache directory with only this machine's native build linked in."""
    directory = tempfile.TemporaryDirectory(prefix="nanoserve-cold-")
    native = cache_root() / "native"
    if native.is_dir():
        (Path(directory.name) / "native").symlink_to(native)
    return directory


def starts(model: str, extra: list[str], caches: list[str], turns: int) -> list[dict[str, object]]:
    """`turns` starts in each cache state, the states alternating within a turn. `busy`: the
    load average before the first start (the starts' own load lingers in it after) was above
    LOAD_QUIET a core."""
    rows: list[dict[str, object]] = []
    load_before = os.getloadavg()[0]
    busy = load_before > LOAD_QUIET * (os.cpu_count() or 1)
    if "warm" in caches:
        one_start(model, extra, dict(os.environ))  # fills the caches; not timed
    for turn in range(turns):
        for state in caches:
            env = dict(os.environ)
            with contextlib.ExitStack() as stack:
                if state == "cold":
                    env["NANOSERVE_CACHE"] = stack.enter_context(cold_cache())
                figures = one_start(model, extra, env)
            rows.append({"cache": state, "turn": turn + 1, "load_1m_before": round(load_before, 2),
                         "busy": busy, **figures})
            print(f"{state} turn {turn + 1}: ready in {figures['ready_s']:.2f} s", flush=True)
    return rows


def medians(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """One row per cache state: the median of each figure over its turns."""
    out = []
    for state in dict.fromkeys(str(r["cache"]) for r in rows):
        turns = [r for r in rows if r["cache"] == state]
        figures = {k: round(statistics.median(float(r[k]) for r in turns if k in r), 3)
                   for k in turns[0] if k.endswith("_s")}
        out.append({"cache": state, "turn": "median", "load_1m_before": turns[0]["load_1m_before"],
                    "busy": turns[0]["busy"], **figures})
    return out


def write_csv(path: Path, rows: list[dict[str, object]], model: str) -> None:
    machine = describe_machine().columns()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=["model", *columns, *machine])
        writer.writeheader()
        for row in rows:
            rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            writer.writerow({"model": Path(model).name, **rounded, **machine})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.startup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model path or GGUF file")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--caches", default="warm,cold", help="comma-separated: warm, cold")
    parser.add_argument("--out", type=Path, default=Path("results/startup.csv"))
    args, extra = parser.parse_known_args(argv)
    caches = [c for c in args.caches.split(",") if c]
    if args.turns < 1 or not caches or any(c not in CACHES for c in caches):
        parser.error(f"--turns must be at least 1 and --caches a list of {', '.join(CACHES)}")
    rows = starts(args.model, extra, caches, args.turns)
    rows += medians(rows)
    write_csv(args.out, rows, args.model)
    for row in rows[-len(caches):]:
        print(f"{row['cache']}: median ready {row['ready_s']} s{' (busy machine)' if row['busy'] else ''}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
