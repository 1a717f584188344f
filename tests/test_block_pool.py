"""The block pool never leaks, never double-frees, and sharing counts holders."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.block_pool import BlockPool, BlockPoolError, block_keys, chain_root


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


def test_block_keys_chain_over_the_parent_so_equal_blocks_after_different_prefixes_differ():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = block_keys([9, 9, 9, 9, 5, 6, 7, 8], 4, 2)
    assert a[0] != b[0] and a[1] != b[1]
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8, 0], 4, 2) == a
    assert block_keys([5, 6, 7, 8], 4, 1, parent=a[0]) == a[1:]


def test_freed_keyed_block_stays_cached_counts_as_free_and_is_found_again():
    pool = BlockPool(4, 4)
    [block] = pool.allocate(1)
    pool.register(block, b"k")
    pool.free([block])
    assert pool.num_free_blocks == 4 and pool.is_completely_free and pool.usage == 0.0
    assert pool.lookup([b"k", b"other"]) == [block]
    pool.take([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 3
    pool.take([block])
    pool.free([block])
    pool.free([block])
    pool.check()
    assert pool.lookup([b"k"]) == [block]


def test_allocate_prefers_truly_free_blocks_then_evicts_least_recently_freed_and_drops_its_key():
    pool = BlockPool(3, 4)
    a, b, c = pool.allocate(3)
    pool.register(a, b"a")
    pool.register(b, b"b")
    pool.free([a])
    pool.free([b])
    pool.free([c])  # unkeyed: truly free
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]  # a was freed before b
    assert pool.lookup([b"a"]) == [] and pool.lookup([b"b"]) == [b]
    pool.check()


def test_a_key_already_cached_keeps_its_block_and_the_duplicate_frees_plainly():
    pool = BlockPool(2, 4)
    a, b = pool.allocate(2)
    pool.register(a, b"k")
    pool.register(b, b"k")
    pool.free([a, b])
    assert pool.lookup([b"k"]) == [a] and pool.num_cached_blocks == 1
    pool.check()


def test_taking_or_registering_a_block_without_its_conditions_raises():
    pool = BlockPool(2, 4)
    [a] = pool.allocate(1)
    with pytest.raises(BlockPoolError, match="caches nothing"):
        pool.take([a])
    with pytest.raises(BlockPoolError, match="free block"):
        pool.register(1, b"k")


@given(st.lists(st.tuples(st.sampled_from(["alloc", "register", "take", "free"]), st.integers(0, 5)),
                max_size=80))
def test_random_cache_operations_keep_the_accounting_consistent(ops):
    pool = BlockPool(6, 4)
    holders: list[list[int]] = []
    for op, n in ops:
        if op == "alloc" and pool.can_allocate(n % 3 + 1):
            holders.append(pool.allocate(n % 3 + 1))
        elif op == "register" and holders:
            held = holders[n % len(holders)]
            pool.register(held[0], bytes([n]))
        elif op == "take":
            hit = pool.lookup([bytes([n])])
            pool.take(hit)
            if hit:
                holders.append(hit)
        elif op == "free" and holders:
            pool.free(holders.pop(n % len(holders)))
        pool.check()
        held = {b for blocks in holders for b in blocks}
        assert pool.num_free_blocks == pool.num_blocks - len(held)
    for blocks in holders:
        pool.free(blocks)
    pool.check()
    assert pool.is_completely_free


def test_chains_under_different_salts_share_no_key():
    ids = list(range(12))
    chains = [block_keys(ids, 4, 3, chain_root(salt)) for salt in (None, "a", "b", "a ")]
    for i, one in enumerate(chains):
        for other in chains[i + 1:]:
            assert not set(one) & set(other)
    assert block_keys(ids, 4, 3, chain_root("a")) == chains[1]
