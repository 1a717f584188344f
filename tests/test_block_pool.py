"""The block pool never leaks, never double-frees, and sharing counts holders."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.block_pool import BlockPool, BlockPoolError


def test_allocate_then_free_returns_pool_to_completely_free():
    pool = BlockPool(num_blocks=8, block_size=4)
    blocks = pool.allocate(5)
    assert pool.num_free_blocks == 3 and len(set(blocks)) == 5
    pool.free(blocks)
    assert pool.is_completely_free


def test_double_free_raises():
    pool = BlockPool(num_blocks=2, block_size=4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free(blocks)


def test_allocating_past_the_pool_raises_and_changes_nothing():
    pool = BlockPool(num_blocks=2, block_size=4)
    with pytest.raises(BlockPoolError):
        pool.allocate(3)
    assert pool.is_completely_free


def test_shared_block_is_free_only_after_its_last_holder_frees_it():
    pool = BlockPool(num_blocks=2, block_size=4)
    blocks = pool.allocate(1)
    pool.share(blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 1
    pool.free(blocks)
    assert pool.is_completely_free


def test_blocks_for_tokens_rounds_up():
    pool = BlockPool(num_blocks=2, block_size=16)
    assert [pool.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "free"]), st.integers(0, 6)), max_size=60))
def test_random_alloc_share_free_never_leaks_or_double_frees(ops):
    pool = BlockPool(num_blocks=12, block_size=4)
    holders: list[list[int]] = []  # each entry: blocks one holder owns
    for op, n in ops:
        if op == "alloc" and pool.can_allocate(n):
            holders.append(pool.allocate(n))
        elif op == "share" and holders:
            blocks = holders[n % len(holders)]
            pool.share(blocks)
            holders.append(list(blocks))
        elif op == "free" and holders:
            pool.free(holders.pop(n % len(holders)))
        held = {b for blocks in holders for b in blocks}
        assert pool.num_free_blocks == pool.num_blocks - len(held)
    for blocks in holders:
        pool.free(blocks)
    assert pool.is_completely_free
