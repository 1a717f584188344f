"""The KV block pool: which cache blocks are free, who holds the rest, and which hold a
computed prompt prefix that a later request may reuse (automatic prefix caching).

Plain Python over integers, so it is cheap to reason about and to property-test. The KV
tensors themselves live in `kv_cache`; a block id here is an index into them.

A full, computed block can be registered under a key chained over its parent's key and its
own token ids (`block_keys`), and the hashes of any images whose embeddings fill some of its
positions, so equal keys mean equal K/V. A request's chain starts from
`chain_root(cache_salt)`: empty for unsalted requests, a digest of the salt otherwise, so
requests with different salts (or one salted, one not) never share a cached block and cannot
learn from a cache hit what another user's prompt was. When no request holds a keyed
block it stays cached (counted as free) until `allocate` needs the room: truly free blocks go
first, then cached ones, least recently freed first, and an evicted block loses its key
before anyone writes to it, so no key ever names overwritten content. Whoever keeps evicted
blocks elsewhere (the prefix cache's disk tier, `engine.prefix_store`) hears of each eviction
through `on_evict`, before the block is given out, so it can still copy the content.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence


class BlockPoolError(RuntimeError):
    """A bookkeeping bug: freeing a free block, or allocating past the pool."""


def chain_root(cache_salt: str | None, adapter_key: str | None = None) -> bytes:
    """The parent key of a request's first block: the digest of its cache salt and its LoRA
    adapter's key, or none when it has neither."""
    if cache_salt is None and adapter_key is None:
        return b""
    root = (b"" if cache_salt is None
            else hashlib.sha256(b"nanoserve cache salt\0" + cache_salt.encode()).digest())
    if adapter_key is None:
        return root
    return hashlib.sha256(b"nanoserve lora\0" + root + adapter_key.encode()).digest()


def block_keys(token_ids: Sequence[int], block_size: int, num_blocks: int,
               parent: bytes = b"", extra: Sequence[bytes] = ()) -> list[bytes]:
    """The keys of the first `num_blocks` full blocks of `token_ids`, each a digest of
    (the previous block's key, this block's ids, `extra[i]` where given: the hashes of the images
    whose embeddings replace some of its ids), the chain starting from `parent`."""
    keys = []
    for index in range(num_blocks):
        ids = array("q", token_ids[index * block_size:(index + 1) * block_size])
        material = extra[index] if index < len(extra) else b""
        if material:
            material = b"\0image\0" + material
        parent = hashlib.sha256(parent + ids.tobytes() + material).digest()
        keys.append(parent)
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int,
                 on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None) -> None:
        """`on_evict`: called with the (block, key) pairs `allocate` evicts, before it returns them."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # free, with no key
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free, keyed; oldest first
        self._block_of_key: dict[bytes, int] = {}
        self._key_of_block: dict[int, bytes] = {}
        self.on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included: they are given out when needed."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a key, held or not."""
        return len(self._block_of_key)

    @property
    def is_completely_free(self) -> bool:
        return self.num_free_blocks == self.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks for new content: truly free ones first, then the least recently
        freed cached ones, whose keys are dropped here, before their content is overwritten."""
        if num_blocks > self.num_free_blocks:
            raise BlockPoolError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids, evicted = [], []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._cached_free.popitem(last=False)
                key = self._key_of_block.pop(block_id)
                del self._block_of_key[key]
                evicted.append((block_id, key))
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return block_ids

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """Every keyed block and its key, held or not."""
        return list(self._key_of_block.items())

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest cached run of `keys` from the first; takes nothing."""
        block_ids = []
        for key in keys:
            block_id = self._block_of_key.get(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def num_unheld(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` nobody holds: taking them uses up that many free blocks."""
        return sum(1 for block_id in block_ids if self._ref_counts[block_id] == 0)

    def take(self, block_ids: Sequence[int]) -> None:
        """Add a holder to cached blocks (a prefix-cache hit), free or already held."""
        for block_id in block_ids:
            if block_id not in self._key_of_block:
                raise BlockPoolError(f"cannot take block {block_id}: it caches nothing")
            if self._ref_counts[block_id] == 0:
                del self._cached_free[block_id]
            self._ref_counts[block_id] += 1

    def register(self, block_id: int, key: bytes) -> None:
        """Record that held block `block_id` now holds the full, computed block `key`. A key
        already cached elsewhere (two requests computed the same block) keeps its block."""
        if self._ref_counts[block_id] == 0:
            raise BlockPoolError(f"cannot register free block {block_id}")
        if key in self._block_of_key or block_id in self._key_of_block:
            return
        self._block_of_key[key] = block_id
        self._key_of_block[block_id] = key

    def share(self, block_ids: list[int]) -> None:
        """Add a holder to blocks already in use (a fork sharing its parent's prefix)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise BlockPoolError(f"cannot share free block {block_id}")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; a block with no holders is free again (cached if
        keyed). The tail goes first, so a chain's deepest blocks are evicted before its root."""
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] == 0:
                raise BlockPoolError(f"double free of block {block_id}")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._key_of_block:
                    self._cached_free[block_id] = None
                else:
                    self._free.append(block_id)

    def check(self) -> None:
        """Raise if the bookkeeping disagrees with itself (for tests after every step)."""
        free = set(self._free)
        cached_free = set(self._cached_free)
        for block_id, count in enumerate(self._ref_counts):
            is_free = block_id in free or block_id in cached_free
            if count < 0 or is_free != (count == 0):
                raise BlockPoolError(f"block {block_id}: ref count {count}, free {is_free}")
            if block_id in cached_free and block_id not in self._key_of_block:
                raise BlockPoolError(f"block {block_id} is cached-free but has no key")
            if block_id in free and block_id in self._key_of_block:
                raise BlockPoolError(f"block {block_id} is free but still keyed")
        if len(free) != len(self._free) or free & cached_free:
            raise BlockPoolError("a block is on a free list twice")
        if {b: k for k, b in self._block_of_key.items()} != self._key_of_block:
            raise BlockPoolError("key and block maps disagree")
