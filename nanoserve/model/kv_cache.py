"""The KV cache tensors: one K and one V tensor per layer, addressed by (block, offset).

Shape [num_kv_heads, num_blocks, block_size, head_dim] per layer: head-major, so gathering
sequences' blocks yields [kv_heads, seqs, ctx, head_dim] already contiguous per head, the
layout attention multiplies without another copy. A request's context is gathered through
its block table; which block belongs to whom is `block_pool`'s business, not this module's.
The native ops (`nanoserve.native.ops`) write and read this same layout in place, through the
block tables, without `write` or `gather`: change it and change csrc/ops.c with it.
"""

from __future__ import annotations

import torch

from nanoserve.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_bytes = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element_bytes
    return per_token * block_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype,
                          budget_bytes: int) -> int:
    return max(1, budget_bytes // bytes_per_block(config, block_size, dtype))


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_kv_heads, num_blocks, block_size, config.head_dim)
        # Zeros, not empty: attention multiplies masked (zero-probability) slots by these
        # values, and 0 * NaN from uninitialized memory would poison a whole row.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ([rows, kv_heads, head_dim]) at flat slots (block * block_size + offset)."""
        heads, dim = k.shape[1:]
        self.k[layer].view(heads, -1, dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
        self.v[layer].view(heads, -1, dim).index_copy_(1, slot_mapping, v.transpose(0, 1))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole block tables: [kv_heads, seqs, blocks * block_size, head_dim], contiguous."""
        seqs, blocks = block_tables.shape
        flat = block_tables.reshape(-1)
        # index_select copies whole blocks; advanced indexing (cache[tables]) copies element by
        # element, several times slower (results/README.md, "Measured design choices").
        k = self.k[layer].index_select(1, flat)
        v = self.v[layer].index_select(1, flat)
        shape = (k.shape[0], seqs, blocks * self.block_size, k.shape[-1])
        return k.view(shape), v.view(shape)
