"""Huge pages under the weights (nanoserve/huge_pages.py): the bytes a tensor holds never change,
the weights' whole 2 MiB runs land on huge pages where Linux agrees, the KV cache stays on small
pages so a prompt makes only about its own K/V resident, and the engine says what it got."""

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from nanoserve import huge_pages
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

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


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.is_file() else "[never]"
    return text[text.index("[") + 1: text.index("]")]


@LINUX_PROC
def test_a_weight_keeps_its_bytes_and_its_whole_runs_land_on_huge_pages():
    weight = torch.randn(5 * 2**20 // 4 + 123)  # 5 MiB and a bit: at least one whole 2 MiB run
    before = weight.clone()
    moved = huge_pages.advise([weight])
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
    assert huge_pages.advise(found) in (0, huge_pages._huge_runs(big)[1])
    assert huge_pages._huge_runs(small) is None


@LINUX_PROC
def test_a_prompt_makes_resident_about_its_own_kv_bytes(tiny_model_dir):
    """The cache is laid out head by head, so a prompt writes a little of each head's region of
    each layer's K and V: on huge pages each of those writes took 2 MiB (the first 512-token
    prompt at the 1.7B shape made 3 GB resident). On small pages the prompt's own bytes, each
    block's share of a region rounded up to whole 4 KiB pages."""
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=65536)
    cache = llm.engine.executor.kv_cache
    tensors = {t.data_ptr(): t for t in cache.tensors()}.values()
    regions = sum(t.shape[0] for t in tensors)  # a head's region in each layer's K and in its V
    assert cache.nbytes / regions >= 8 * huge_pages.HUGE_PAGE  # so a huge page a region would show

    def resident() -> int:
        return sum(_mapping_field(t.data_ptr(), "Rss") for t in tensors)

    before = resident()
    [done] = llm.generate([list(range(3, 3 + 64))], SamplingParams(max_tokens=1, temperature=0.0))
    tokens = len(done.prompt_token_ids)
    written = tokens * sum(t.shape[0] * t.shape[-1] * t.element_size() for t in tensors)  # each head's row
    blocks = -(-tokens // cache.block_size)  # wherever the pool put them: a page a block and region at most
    assert 0 < resident() - before <= written + regions * blocks * 4096


def test_the_engine_says_what_it_got(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        LLM(str(tiny_model_dir), device="cpu", kv_cache_gb=0.01)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("huge pages: ")]
    assert line.endswith("MB of weights") or line.endswith("refused them)")


@LINUX_PROC
def test_gathered_tensors_keep_their_bytes_in_one_arena_that_starts_on_a_huge_page():
    small = [torch.randn(1000 + 7 * i) for i in range(300)]  # 2.4 MiB of tensors under 2 MiB each
    halves = torch.arange(64, dtype=torch.float16), torch.arange(5, dtype=torch.uint8)
    view_of_larger, kept = torch.randn(1000)[10:], torch.randn(600_000)
    before = [t.clone() for t in (*small, *halves, view_of_larger, kept)]
    moved = huge_pages.gather([*small, *halves, small[0], view_of_larger, kept], keep=[kept])
    after = (*small, *halves, view_of_larger, kept)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(after, before, strict=True))
    arena = small[0].untyped_storage()
    assert all(t.untyped_storage().data_ptr() == arena.data_ptr() for t in (*small, *halves))
    assert all(t.data_ptr() % huge_pages.ALIGNMENT == 0 for t in (*small, *halves))
    line = huge_pages.ALIGNMENT
    assert (small[0].data_ptr() % huge_pages.HUGE_PAGE == 0 and
            moved == sum(-(-t.nbytes // line) * line for t in (*small, *halves)))
    for stays in (view_of_larger, kept):  # a view of a larger storage, a tensor the caller keeps
        assert stays.untyped_storage().data_ptr() != arena.data_ptr()
    small[1].add_(1)  # the tensors are still separate
    assert torch.equal(small[2], before[2])


def test_nothing_is_gathered_when_huge_pages_are_off_or_the_tensors_fill_no_huge_page(monkeypatch):
    few = [torch.randn(1000) for _ in range(3)]
    pointers = [t.data_ptr() for t in few]
    assert huge_pages.gather(few) == 0 and [t.data_ptr() for t in few] == pointers
    monkeypatch.setenv("NANOSERVE_HUGE_PAGES", "0")
    many = [torch.randn(10_000) for _ in range(100)]
    pointers = [t.data_ptr() for t in many]
    assert huge_pages.gather(many) == 0 and [t.data_ptr() for t in many] == pointers
