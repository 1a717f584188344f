"""The shared-memory collectives (nanoserve/distributed/shared_memory.py): the rank-ordered sum
bit for bit, the gather exact, buffers reused safely by ranks that run at different speeds, a
rank that never arrives named within the timeout, no file left behind; and the engine at N = 2
over them gives one rank's tokens and logprobs.

Ranks run as threads of this process over one in-process store (each maps the buffer itself, as
a process would), except in the engine test.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import rank_threads
import torch
import torch.distributed as dist
from test_parallel_blocks import decode

from nanoserve import native
from nanoserve.distributed import shared_memory
from nanoserve.distributed.shared_memory import SharedMemoryGroup
from nanoserve.llm import LLM

pytestmark = pytest.mark.skipif(not shared_memory.enabled(), reason="no /dev/shm or not an x86 CPU: "
                                "tensor parallelism takes gloo's collectives here")


def in_threads(world: int, work, store: dist.Store | None = None, **options) -> list:
    """`work(group, rank)` for each rank's SharedMemoryGroup, one thread a rank."""
    def join(store: dist.Store, rank: int, world: int) -> SharedMemoryGroup:
        return SharedMemoryGroup.join(store, rank, world, **{"timeout_s": 30.0, **options})

    return rank_threads.in_threads(world, work, join, store)


def partials(world: int, rows: int, cols: int = 1000) -> list[torch.Tensor]:
    # Magnitudes 10^r apart: any other order of the sum moves low bits.
    return [torch.randn(rows, cols, generator=torch.Generator().manual_seed(r)) * 10 ** r
            for r in range(world)]


# The exchange in C (native/collective.py) and in Python: the same bits.
EXCHANGES = [pytest.param(True, id="native-exchange",
                          marks=pytest.mark.skipif(native.library() is None, reason=native.status())),
             pytest.param(False, id="python-exchange")]


@pytest.mark.parametrize("native_exchange", EXCHANGES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_all_reduce_is_the_sum_in_rank_order_bit_for_bit_on_every_rank(rows, native_exchange):
    world = 4
    parts = partials(world, rows)
    in_order = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    results = in_threads(world, lambda group, rank: (group.native_exchange is not None,
                                                     group.all_reduce(parts[rank])),
                         native_exchange=native_exchange)
    for ran_natively, result in results:
        assert ran_natively == native_exchange
        assert torch.equal(result, in_order)


def test_the_all_gather_puts_every_rank_side_by_side_in_rank_order():
    parts = partials(3, 7, 5)
    for result in in_threads(3, lambda group, rank: group.all_gather(parts[rank])):
        assert torch.equal(result, torch.cat(parts, dim=1))


@pytest.mark.parametrize("native_exchange", EXCHANGES)
def test_ranks_at_different_speeds_reuse_the_buffers_without_reading_a_later_write(native_exchange):
    world, rounds = 3, 60
    parts = [partials(world, 2, 16) for _ in range(rounds)]

    def work(group, rank):
        pace = random.Random(rank)
        out = []
        for r in range(rounds):
            time.sleep(pace.random() * 1e-3)
            out.append(group.all_reduce(parts[r][rank]))
        return out

    # A slot of one row: every call is two exchanges, both halves reused all along.
    for result in in_threads(world, work, slot_bytes=64, native_exchange=native_exchange):
        for r in range(rounds):
            assert torch.equal(result[r], (parts[r][0] + parts[r][1]) + parts[r][2])


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    def work(group, rank):
        if rank == 1:
            return None
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 did not arrive within 1 s"):
            group.all_reduce(torch.ones(1, 4))
        return time.monotonic() - start

    store = dist.HashStore()
    waited = in_threads(2, work, timeout_s=1.0, store=store)[0]
    assert waited < 10
    assert not Path(store.get("shared_memory/path").decode()).exists()  # unlinked all the same


def test_the_buffer_file_is_gone_once_every_rank_has_mapped_it():
    def work(group, rank):
        group.all_reduce(torch.ones(1, 4))
        return group.path

    paths = in_threads(2, work)
    assert paths[0] == paths[1] and not paths[0].exists()


@pytest.mark.skipif(native.library() is None, reason="the native library is off: no GGUF blocks to run")
def test_two_ranks_over_shared_memory_decode_the_tokens_and_logprobs_of_one(wide_gguf):
    model = str(wide_gguf("Q4_1"))
    # One kernel both ways: the choice is measured per engine (and at its thread count), and two
    # kernels sum in two orders; one rank's bits are the promise for one kernel.
    kernel = "native-quant-x8"
    alone = decode(LLM(model, device="cpu", num_kv_blocks=64, linear_kernel=kernel))
    llm = LLM(model, device="cpu", tensor_parallel_size=2, num_kv_blocks=64, linear_kernel=kernel)
    try:
        assert llm.engine.tp.collectives.local is not None
        assert decode(llm) == alone
    finally:
        llm.engine.close()


def test_a_wait_ends_with_the_error_of_its_check_long_before_the_timeout():
    def exited() -> None:
        raise RuntimeError("rank 1 (exit status -9) exited")

    def work(group, rank):
        if rank == 1:
            return None
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(exit status -9\) exited"):
            group.all_gather(torch.ones(1, 4))
        return time.monotonic() - start

    assert in_threads(2, work, timeout_s=60.0, check=exited)[0] < 30


def test_a_buffer_file_whose_rank_0_is_gone_is_removed_when_another_group_starts():
    orphan = shared_memory.SHM_DIR / "nanoserve-tp-999999999-0123456789ab"
    orphan.write_bytes(b"")
    in_threads(2, lambda group, rank: group.all_reduce(torch.ones(1, 4)))
    assert not orphan.exists()
