"""The KV cache tensors: one K and one V tensor per layer, addressed by (block, offset).

Shape [num_kv_heads, num_blocks, block_size, head_dim] per layer: head-major, so gathering
sequences' blocks yields [kv_heads, seqs, ctx, head_dim] already contiguous per head, the
layout attention multiplies without another copy. A request's context is gathered through
its block table; which block belongs to whom is `block_pool`'s business, not this module's.
The native ops (`nanoserve.native.ops`) write and read this same layout in place, through the
block tables, without `write` or `gather`: change it and change csrc/stages/ops.c with it.

The cache's dtype (`--kv-cache-dtype`) is its own, not necessarily the activations':
- auto (the default): float16 beside float32 activations on the CPU, half float32's bytes
  (`python -m nanoserve.bench.experiments.kv_cache` measures its agreement with float32 K/V;
  docs/kv-cache.md); elsewhere the activations' dtype, stored as computed.
- float32, float16, bfloat16: K/V cast as they are written (rounded to nearest even) and cast
  back to the activations' dtype as they are read; the native attention reads them in place.
- fp8 (CUDA only): float8_e4m3fn, clamped to its range, without a scale.
- q8_0: int8 codes in the shape above, and one float32 scale per head per token
  (`k_scales`/`v_scales`, [num_kv_heads, num_blocks, block_size]): ggml's q8_0 arithmetic
  (scale = max|x| / 127, codes round(x / scale)) over each head's whole row of head_dim values
  instead of ggml's blocks of 32. Why one scale a row: the row is the unit the K/V write
  produces and the attention reads, so the native attention dequantizes a row with one
  broadcast scale into the buffer its dot products already read; it takes any head_dim
  (ggml's blocks need a multiple of 32: the tests' tiny model has 16, some families 80); and
  a float32 scale needs no float16 rounding kept identical between C and torch. Either way a
  row's codes depend on that row alone, so a token's K/V (and its tokens) never depend on its
  neighbours in a batch, nor on whether a prefill chunk or a decode step wrote it. The cost:
  at head_dim 64 ggml's layout (two float16 scales) takes the same 68 bytes a row and rounds
  somewhat closer; `python -m nanoserve.bench.experiments.kv_cache` measures both round trips on the
  default model (results/kv_cache_rounding.csv) and the agreement with float32 K/V the row
  scale gives (docs/kv-cache.md).
  The native write (csrc/stages/ops.c quantize_row_q8) and `quantize_q8` here are the same float32
  arithmetic, so both paths store the same codes and scales and read the same numbers; the
  native attention dequantizes one row at a time inside its loop, `gather` (the torch path)
  the gathered context.
"""

from __future__ import annotations

import mmap

import torch

from nanoserve.config import ModelConfig
from nanoserve.errors import InvalidRequestError

Q8_0 = "q8_0"
FP8 = "fp8"
# What each resolved cache dtype stores ("auto" resolves to the activations' dtype, float16 included).
STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           FP8: torch.float8_e4m3fn, Q8_0: torch.int8}
# The caches the native attention reads in place; any other runs the torch attention.
NATIVE_KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", Q8_0)
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
_SCALE_BYTES = 4  # a q8_0 row's float32 scale


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> str:
    """The cache dtype --kv-cache-dtype `name` means beside activations of `dtype` on `device`
    (auto: float16 beside float32 on the CPU, else `dtype`'s own), refused by name where it
    cannot run."""
    if name == FP8 and device.type != "cuda":
        raise InvalidRequestError("an fp8 KV cache runs on CUDA only; on the CPU, q8_0 holds 3.8x float32's "
                                  "tokens (bfloat16: 2x)", param="kv_cache_dtype")
    if name != "auto":
        return name
    if dtype == torch.float32 and device.type == "cpu":
        return "float16"
    return str(dtype).removeprefix("torch.")


def bytes_per_token(config: ModelConfig, cache_dtype: str) -> int:
    """K and V of one token over every layer, in a cache of `cache_dtype` (a resolved name)."""
    rows = 2 * config.num_layers * config.num_kv_heads
    if cache_dtype == Q8_0:
        return rows * (config.head_dim + _SCALE_BYTES)
    return rows * config.head_dim * STORAGE[cache_dtype].itemsize


def bytes_per_block(config: ModelConfig, block_size: int, cache_dtype: str) -> int:
    return bytes_per_token(config, cache_dtype) * block_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, cache_dtype: str, budget_bytes: int) -> int:
    return max(1, budget_bytes // bytes_per_block(config, block_size, cache_dtype))


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8_0 of each row along the last dimension: int8 codes (x's shape) and float32 scales
    (x's shape without its last dimension). csrc/stages/ops.c's quantize_row_q8, in torch: the same
    float32 operations in the same order, rounded half to even, so the codes are its codes."""
    x = x.float()
    scales = x.abs().amax(dim=-1) / 127.0
    # A scale below the smallest normal float (a zero row) has no finite inverse: zero codes.
    usable = scales >= torch.finfo(torch.float32).tiny
    inverse = torch.where(usable, 1.0 / torch.where(usable, scales, 1.0), 0.0)
    return torch.round(x * inverse.unsqueeze(-1)).to(torch.int8), scales


def dequantize_q8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 code * scale, each row by its own scale (csrc/stages/ops.c's dequantize_q8)."""
    return codes.float() * scales.unsqueeze(-1)


def zero_filled(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros that costs nothing until written. On the CPU a private anonymous
    mapping: the kernel guarantees its pages read as zero and backs each with memory at its
    first write, so a cache of many GiB starts at once and holds only the pages requests have
    written (torch.zeros wrote every page at start-up; torch.empty's content is whatever the
    allocator had, and slots never written are read: see KVCache). Elsewhere torch.zeros,
    which a GPU fills at its memory's speed."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, dtype.itemsize * torch.Size(shape).numel(),
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the buffer it views, so the mapping lives as long as the tensor.
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def _movable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or its bytes where index_copy_ / index_select have no kernel for its dtype (fp8)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, cache_dtype: str | None = None) -> None:
        """`dtype`: the activations'; `cache_dtype`: what the cache stores (a resolved
        `resolve_kv_cache_dtype` name; None: `dtype` itself)."""
        self.cache_dtype = cache_dtype or str(dtype).removeprefix("torch.")
        self.dtype = dtype
        shape = (config.num_kv_heads, num_blocks, block_size, config.head_dim)
        storage = STORAGE[self.cache_dtype]
        # Zeros, never uninitialized memory: the torch attention multiplies a sequence's masked
        # slots past its length (a block's unwritten tail, a shorter sequence's padding blocks)
        # by zero probabilities, and 0 * NaN would poison a whole row. `zero_filled` gives
        # zeros without writing them.
        layers = range(config.num_layers)
        self.k = [zero_filled(shape, storage, device) for _ in layers]
        self.v = [zero_filled(shape, storage, device) for _ in layers]
        self.k_scales: list[torch.Tensor] | None = None
        self.v_scales: list[torch.Tensor] | None = None
        if self.cache_dtype == Q8_0:
            self.k_scales = [zero_filled(shape[:3], torch.float32, device) for _ in layers]
            self.v_scales = [zero_filled(shape[:3], torch.float32, device) for _ in layers]
        self.num_blocks = num_blocks
        self.block_size = block_size

    def tensors(self) -> list[torch.Tensor]:
        """Every layer's K and V (and a q8_0 cache's scales)."""
        return self.k + self.v + (self.k_scales or []) + (self.v_scales or [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s K and V scales in a q8_0 cache; (None, None) in any other."""
        if self.k_scales is None or self.v_scales is None:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ([rows, kv_heads, head_dim]) at flat slots (block * block_size + offset)."""
        heads, dim = k.shape[1:]
        for cache, scales, new in ((self.k[layer], self.scales(layer)[0], k),
                                   (self.v[layer], self.scales(layer)[1], v)):
            if scales is not None:
                codes, row_scales = quantize_q8(new)
                scales.view(heads, -1).index_copy_(1, slot_mapping, row_scales.transpose(0, 1))
                new = codes
            elif self.cache_dtype == FP8:
                new = new.clamp(-_FP8_MAX, _FP8_MAX)
            new = _movable(new.to(cache.dtype))
            _movable(cache).view(heads, -1, dim).index_copy_(1, slot_mapping, new.transpose(0, 1))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole block tables: [kv_heads, seqs, blocks * block_size, head_dim], contiguous,
        in the activations' dtype."""
        seqs, blocks = block_tables.shape
        flat = block_tables.reshape(-1)
        gathered = []
        for cache, scales in ((self.k[layer], self.scales(layer)[0]), (self.v[layer], self.scales(layer)[1])):
            # index_select copies whole blocks; advanced indexing (cache[tables]) copies element by
            # element, several times slower (results/README.md, "Measured design choices").
            rows = _movable(cache).index_select(1, flat).view(cache.dtype)
            if scales is not None:
                rows = dequantize_q8(rows, scales.index_select(1, flat))
            rows = rows.to(self.dtype)
            gathered.append(rows.view(rows.shape[0], seqs, blocks * self.block_size, rows.shape[-1]))
        return gathered[0], gathered[1]

    def _stored(self) -> list[torch.Tensor]:
        """Every tensor that holds part of a block (block index along dim 1), in a fixed order:
        each layer's K, each layer's V, then the q8_0 scales (K's, V's); fp8 as its bytes."""
        tensors = self.k + self.v + (self.k_scales or []) + (self.v_scales or [])
        return [_movable(t) for t in tensors]

    def block_layout(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """The dtype and the one-block shape of each tensor `read_blocks` returns, in its order."""
        return [(t.dtype, (t.shape[0], 1, *t.shape[2:])) for t in self._stored()]

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies on the CPU of whole blocks' contents, exactly as stored (the prefix cache's
        disk tier): one tensor per `block_layout` entry, [.., len(block_ids), ..] each."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        return [t.index_select(1, index).cpu() for t in self._stored()]

    def write_blocks(self, block_ids: list[int], contents: list[torch.Tensor]) -> None:
        """Store whole blocks' contents as `read_blocks` returned them, at `block_ids`."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        for cache, content in zip(self._stored(), contents, strict=True):
            cache.index_copy_(1, index, content.to(cache.device))
