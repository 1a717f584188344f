"""The KV block pool: which cache blocks are free, and who holds the rest.

Plain Python over integers, so it is cheap to reason about and to property-test. The KV
tensors themselves live in `kv_cache`; a block id here is an index into them.
"""

from __future__ import annotations

from collections import deque


class BlockPoolError(RuntimeError):
    """A bookkeeping bug: freeing a free block, or allocating past the pool."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def is_completely_free(self) -> bool:
        return len(self._free) == self.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise BlockPoolError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add a holder to blocks already in use (a fork sharing its parent's prefix)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise BlockPoolError(f"cannot share free block {block_id}")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; a block with no holders is free again."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise BlockPoolError(f"double free of block {block_id}")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
