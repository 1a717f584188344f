"""Huge pages under the weights and the KV cache (nanoserve/huge_pages.py): the bytes a tensor
holds never change, the weights' whole 2 MiB runs land on huge pages where Linux agrees, a marked
cache still takes no memory until written, and the engine says what it got."""

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_model import CONFIG

from nanoserve import huge_pages
from nanoserve.llm import LLM
from nanoserve.model.kv_cache import KVCache, bytes_per_token

LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc")


def _mapping_field(address: int, field: str) -> int:
    """`field` (kB in smaps) of the mapping holding `address`, in bytes."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.is_file() else "[never]"
    return text[text.index("[") + 1: text.index("]")]


@LINUX_PROC
def test_a_weight_keeps_its_bytes_and_its_whole_runs_land_on_huge_pages():
    weight = torch.randn(5 * 2**20 // 4 + 123)  # 5 MiB and a bit: at least one whole 2 MiB run
    before = weight.clone()
    moved = huge_pages.advise([weight], collapse=True)
    assert torch.equal(weight, before)
    if moved == 0:
        pytest.skip(f"this system refuses MADV_COLLAPSE (THP '{_thp_mode()}', or a kernel before 6.1)")
    start, length = huge_pages._huge_runs(weight)
    assert moved == length >= 2 * 2**20 and start % huge_pages.HUGE_PAGE == 0
    assert _mapping_field(start, "AnonHugePages") >= moved


def test_a_tensor_held_twice_is_advised_once_and_small_ones_not_at_all():
    @dataclass(frozen=True)
    class Packed:
        blocks: torch.Tensor
        parts: list[torch.Tensor]

    big, small = torch.zeros(3 * 2**20), torch.zeros(1000)
    found = list(huge_pages.tensors_in([Packed(big, [small, big[2**20:]]), (big,)]))
    assert len(found) == 4 and all(t.untyped_storage().data_ptr() in
                                   (big.data_ptr(), small.data_ptr()) for t in found)
    assert huge_pages.advise(found, collapse=False) in (0, huge_pages._huge_runs(big)[1])
    assert huge_pages._huge_runs(small) is None


@LINUX_PROC
def test_a_marked_kv_cache_still_holds_no_page_until_written():
    cache = KVCache(CONFIG, 512 * 2**20 // bytes_per_token(CONFIG, "float16") // 16, 16, torch.float32,
                    torch.device("cpu"), "float16")
    assert cache.nbytes > 500 * 2**20
    before = _resident_bytes()
    huge_pages.advise(cache.tensors(), collapse=False)
    assert all(torch.count_nonzero(t) == 0 for t in cache.tensors())  # reads map the zero page
    assert _resident_bytes() - before < 64 * 2**20
    k = torch.ones(1, CONFIG.num_kv_heads, CONFIG.head_dim)
    cache.write(0, torch.tensor([cache.num_blocks * 16 - 1]), k, k)  # one slot: a page of K, one of V
    assert _resident_bytes() - before < 64 * 2**20


def test_the_engine_says_what_it_got(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        LLM(str(tiny_model_dir), device="cpu", kv_cache_gb=0.01)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("huge pages: ")]
    assert line.endswith("MB of weights, the KV cache as it is written") or line.endswith("refused them)")
