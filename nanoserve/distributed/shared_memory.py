"""The collectives of a forward between tensor-parallel ranks on one machine, through one buffer
the ranks map (a file in /dev/shm), as vLLM's CPU backend and SGLang do.

Owns: the buffer's layout, its creation and mapping, and two collectives over it:
- `all_reduce`: each rank writes its partial into its slot, one barrier, and every rank sums the
  slots in rank order 0..N-1 (so a row's bits never depend on which rank arrived first);
- `all_gather`: the same barrier, the slots side by side.
Layout: one counter a rank (its own cache line), then two halves of N slots of SLOT_BYTES. The
k-th exchange uses half k % 2: a rank writes half k % 2 again at exchange k + 2 only after every
rank published k + 1, which each did after reading exchange k, so one barrier an exchange is
enough. A tensor larger than a slot goes in row chunks (a row's sum or copy is the same).
With the native library loaded, the write, the publication, the first spin and a float32 sum
are one C call (native/collective.py); the waiting below takes over where its spin runs out.
Waiting spins a few microseconds, then yields the core (releasing the GIL), then sleeps: with
more ranks than cores a spinning rank would take the core of the rank it waits for. A wait gives
up after its timeout naming the rank, or when its `check` raises (rank 0: a worker exited).
Refuses: ranks on other machines (gloo's, `machine_id` tells them apart), GPUs (NCCL's), and
CPUs other than x86: the counter is published by a plain store after the data, which x86's
store order keeps; weaker orders would need fences Python cannot issue.
NANOSERVE_TP_SHARED_MEMORY=0 turns it off (gloo then), for comparing the two.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nanoserve.native import collective

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 1 << 20
COUNTER_STRIDE = 8  # int64 words: a rank's counter alone on its 64-byte cache line
SPIN_S = 20e-6  # then yield the core
YIELD_S = 2e-3  # then sleep
SLEEP_S = 50e-6
CHECK_S = 0.1  # while sleeping, how often `check` is asked whether to give up
X86 = ("x86_64", "amd64", "i386", "i686")


def enabled() -> bool:
    """Whether this machine can run it, and it is not turned off."""
    return (os.environ.get("NANOSERVE_TP_SHARED_MEMORY", "1") != "0" and platform.machine().lower() in X86
            and SHM_DIR.is_dir())


def machine_id() -> str:
    """The same string on every process of one booted machine (containers included), else not."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def remove_orphans() -> None:
    """Remove the buffer files of rank-0 processes that are gone (one killed before its first
    exchange keeps its file: the name holds its pid)."""
    for path in SHM_DIR.glob("nanoserve-tp-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


@dataclass
class SharedMemoryGroup:
    """One rank's view of the buffer; every rank calls the same collectives in the same order."""

    rank: int
    world: int
    path: Path
    buffer: mmap.mmap
    timeout_s: float
    slot_bytes: int = SLOT_BYTES
    # Asked while a wait sleeps; raises to end it (rank 0: a worker process that exited), so the
    # step fails naming the rank rather than waiting out the timeout.
    check: Callable[[], None] | None = None
    counters: np.ndarray = field(init=False)
    data: torch.Tensor = field(init=False)
    _counters_address: int = field(init=False)  # for the C exchange
    _data_address: int = field(init=False)
    views: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    exchanges: int = 0
    unlinked: bool = False
    # The exchange in C (None: the library is off, or `native_exchange=False`); both give the same bits.
    native_exchange: collective.NativeExchange | None = field(default_factory=collective.load)

    def __post_init__(self) -> None:
        self.counters = np.frombuffer(self.buffer, dtype=np.int64, count=self.world * COUNTER_STRIDE)
        self.data = torch.frombuffer(self.buffer, dtype=torch.uint8, offset=self.counters.nbytes,
                                     count=2 * self.world * self.slot_bytes)
        self._counters_address = self.counters.ctypes.data
        self._data_address = self.data.data_ptr()

    @staticmethod
    def size(world: int, slot_bytes: int = SLOT_BYTES) -> int:
        return world * COUNTER_STRIDE * 8 + 2 * world * slot_bytes

    @classmethod
    def join(cls, store: dist.Store, rank: int, world: int, timeout_s: float,
             slot_bytes: int = SLOT_BYTES, check: Callable[[], None] | None = None,
             native_exchange: bool = True) -> SharedMemoryGroup:
        """Rank 0 creates the buffer and names it in the store; the others map it. Blocks no rank
        on another (rank 0 unlinks the file once every rank has been seen in an exchange).
        `native_exchange=False` keeps the Python exchange where the library is loaded."""
        size = cls.size(world, slot_bytes)
        if rank == 0:
            remove_orphans()
            path = SHM_DIR / f"nanoserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)  # zeros: every counter starts at 0
        else:
            path = Path(store.get("shared_memory/path").decode())
            fd = os.open(path, os.O_RDWR)
        try:
            buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if rank == 0:
            store.set("shared_memory/path", str(path))  # named once it has its size
        return cls(rank, world, path, buffer, timeout_s, slot_bytes, check,
                   native_exchange=collective.load() if native_exchange else None)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x` [rows, cols], added in rank order 0..N-1 on every rank."""
        return self._by_row_chunks(x, self._reduce_chunk)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [rows, cols] side by side in rank order: [rows, N * cols]."""
        return self._by_row_chunks(x, self._gather_chunk)

    def close(self) -> None:
        self._unlink()

    def _by_row_chunks(self, x: torch.Tensor, exchange) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"shared-memory collectives take [rows, cols] tensors; got {list(x.shape)}")
        row_bytes = max(1, x.shape[1] * x.element_size())
        if row_bytes > self.slot_bytes:
            raise ValueError(f"a row of {row_bytes} bytes does not fit a {self.slot_bytes}-byte slot")
        rows = self.slot_bytes // row_bytes
        if x.shape[0] <= rows:
            return exchange(x)
        return torch.cat([exchange(part) for part in x.split(rows)])

    def _reduce_chunk(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_exchange is not None and x.dtype is torch.float32:
            return self._all_reduce_natively(x)
        slots = self._exchange(x)
        out = slots[0].clone()
        for rank in range(1, self.world):
            out += slots[rank]
        return out.view(x.shape)

    def _gather_chunk(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape
        return self._exchange(x).view(self.world, rows, cols).transpose(0, 1).reshape(rows, self.world * cols)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Write `x` into this rank's slot, wait for every rank's; returns the N slots as a view
        [N, x.numel()] (valid until the exchange after next)."""
        if self.native_exchange is not None:
            self._publish_natively(x)
            return self._halves(x.dtype)[self.exchanges % 2, :, :x.numel()]
        self.exchanges += 1
        slots = self._halves(x.dtype)[self.exchanges % 2, :, :x.numel()]
        try:
            slots[self.rank].copy_(x.reshape(-1))
            self.counters[self.rank * COUNTER_STRIDE] = self.exchanges  # after the data: x86 keeps the order
            self._wait_for_all(self.exchanges)
        finally:
            # Every rank has mapped the file (or the group is broken): the name can go.
            self._unlink()
        return slots

    def _all_reduce_natively(self, x: torch.Tensor) -> torch.Tensor:
        """The hot path of a step (two a layer): one C call, addresses rather than tensor views
        into the buffer; Python's wait and a second call only where the spin ran out."""
        half = self._next_half()
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=torch.float32)
        try:
            if self.native_exchange.all_reduce(self._counters_address, COUNTER_STRIDE, self.rank, self.world,
                                               self.exchanges, half, self.slot_bytes, x.data_ptr(), x.numel(),
                                               out.data_ptr(), collective.SPIN_US):
                self._wait_for_all(self.exchanges)
                self.native_exchange.sum_slots(half, self.slot_bytes // 4, self.world, x.numel(),
                                               out.data_ptr())
        finally:
            self._unlink()
        return out

    def _publish_natively(self, x: torch.Tensor) -> int:
        """`_exchange` in one C call (write, publish, spin), Python's wait only where the spin ran
        out; returns the address of the exchange's half of the buffer."""
        half = self._next_half()
        x = x.contiguous()
        try:
            if self.native_exchange.publish(self._counters_address, COUNTER_STRIDE, self.rank, self.world,
                                            self.exchanges, half, self.slot_bytes, x.data_ptr(),
                                            x.numel() * x.element_size(), collective.SPIN_US):
                self._wait_for_all(self.exchanges)
        finally:
            self._unlink()
        return half

    def _next_half(self) -> int:
        """Counts the next exchange; the address of the buffer half it uses (exchange k: k % 2)."""
        self.exchanges += 1
        return self._data_address + (self.exchanges % 2) * self.world * self.slot_bytes

    def _halves(self, dtype: torch.dtype) -> torch.Tensor:
        """The data as [2 halves, N slots, elements of `dtype`], made once per dtype."""
        if dtype not in self.views:
            self.views[dtype] = self.data.view(2, self.world, self.slot_bytes).view(dtype)
        return self.views[dtype]

    def _wait_for_all(self, exchange: int) -> None:
        started, checked = time.perf_counter(), 0.0
        for rank in range(self.world):
            polls = 0
            while self.counters[rank * COUNTER_STRIDE] < exchange:
                polls += 1
                if polls % 32:
                    continue
                waited = time.perf_counter() - started
                if waited > self.timeout_s:
                    raise RuntimeError(f"shared-memory collective: rank {rank} did not arrive within "
                                       f"{self.timeout_s:.0f} s")
                if waited > YIELD_S:
                    time.sleep(SLEEP_S)
                    if self.check is not None and waited - checked > CHECK_S:
                        checked = waited
                        self.check()
                elif waited > SPIN_S:
                    os.sched_yield()

    def _unlink(self) -> None:
        if self.rank == 0 and not self.unlinked:
            self.unlinked = True
            self.path.unlink(missing_ok=True)


# ---- the microbenchmark: python -m nanoserve.distributed.shared_memory --ranks 2 -----------
# Each round times `iters` calls of every collective in turn (so a busy neighbour disturbs all
# of them alike), one figure a round: microseconds a call. Rank 0 writes every round to the CSV;
# the median and the best round are printed.

GOAL_US = 50.0  # issue 28: a collective of a decode step's size
COLLECTIVES = ("shared-memory all_reduce", "shared-memory all_gather", "gloo allreduce")


def _bench_rank(rank: int, args: argparse.Namespace) -> None:
    store = dist.TCPStore("127.0.0.1", args.port, args.ranks, rank == 0, timedelta(seconds=60))
    torch.set_num_threads(1)
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(rank))
    shared = SharedMemoryGroup.join(store, rank, args.ranks, timeout_s=60)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, args.ranks, timedelta(seconds=60))
    runs = dict(zip(COLLECTIVES, (lambda: shared.all_reduce(x), lambda: shared.all_gather(x),
                                  lambda: gloo.allreduce([x.clone()]).wait()), strict=True))
    for run in runs.values():
        for _ in range(args.iters // 10):  # warm-up, every rank in step
            run()
    rows = []
    for round_index in range(args.rounds):
        for name, run in runs.items():
            gloo.barrier().wait()
            start = time.perf_counter()
            for _ in range(args.iters):
                run()
            rows.append((round_index, name, 1e6 * (time.perf_counter() - start) / args.iters))
    gloo.barrier().wait()
    shared.close()
    if rank == 0:
        _report(rows, args)


def _report(rows: list[tuple[int, str, float]], args: argparse.Namespace) -> None:
    from nanoserve.machine import cpu_model

    cpu, cores = cpu_model(), len(os.sched_getaffinity(0))
    load_1min = os.getloadavg()[0]
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w") as out:
        out.write("collective,round,us_per_call,ranks,rows,cols,iters,goal_us,cpu,cores,load_1min\n")
        for round_index, name, us in rows:
            out.write(f"{name},{round_index},{us:.2f},{args.ranks},{args.rows},{args.cols},{args.iters},"
                      f"{GOAL_US:g},\"{cpu}\",{cores},{load_1min:.2f}\n")
    print(f"{args.ranks} ranks, [{args.rows}, {args.cols}] float32, {args.rounds} rounds of {args.iters} "
          f"calls, on {cpu} ({cores} cores, load {load_1min:.2f}); goal <= {GOAL_US:g} us", flush=True)
    for name in COLLECTIVES:
        times = sorted(us for _, each, us in rows if each == name)
        print(f"  {name:26s} median {times[len(times) // 2]:8.1f} us a call, best round {times[0]:8.1f} us",
              flush=True)
    print(f"wrote {args.csv}", flush=True)



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time one collective of a decode step's size between "
                                     "local processes: shared memory against gloo.")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16, help="rows a step (decode: its sequences)")
    parser.add_argument("--cols", type=int, default=576, help="the hidden size (the default model's: 576)")
    parser.add_argument("--iters", type=int, default=2000, help="calls a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the collectives alternating")
    parser.add_argument("--csv", type=Path, default=Path("results/shared_memory.csv"))
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        _bench_rank(args.rank, args)
        return 0
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = ["--ranks", str(args.ranks), "--rows", str(args.rows), "--cols", str(args.cols),
              "--iters", str(args.iters), "--rounds", str(args.rounds), "--csv", str(args.csv),
              "--port", str(port)]
    ranks = [subprocess.Popen([sys.executable, "-m", "nanoserve.distributed.shared_memory", *common,
                               "--rank", str(rank)]) for rank in range(args.ranks)]
    return max(rank.wait() for rank in ranks)


if __name__ == "__main__":
    sys.exit(main())
