"""GGUF block-quantized weights: what the blocks hold, and the plain torch arithmetic on them.

Owns: `QuantizedWeight` (a matrix [out, in] kept as the GGUF's own row-major block bytes, a
uint8 tensor [out, bytes_per_row], never expanded), the block layouts of the GGUF weight types
nanoserve runs in their own bytes (documented once, below, as ggml-common.h defines them; F16
and BF16 are "blocks" of one value), a torch reference dequantizer per format (the tests hold
them against `gguf.quants.dequantize`, bit for bit), quantizers for Q8_0 and Q4_0 (for
`--quantize` of float checkpoints; held against `gguf.quants.quantize`), and `random_weight`
(random blocks with sane scales, for tests and benchmarks).
Refuses: speed. The native kernels (`nanoserve.native.quant`) do the multiplies; this module is
the obvious version they are tested against, and the path that dequantizes at load where the
native library is off.

Block layouts (little-endian; f16 is IEEE half; a row of `in` values is `in / values` blocks):

| format | values | bytes | layout | value of element i |
|---|---|---|---|---|
| Q8_0 | 32 | 34 | d:f16, qs:int8[32] | d * qs[i] |
| Q4_0 | 32 | 18 | d:f16, qs:u8[16] | d * (nib(i) - 8) |
| Q4_1 | 32 | 20 | d:f16, m:f16, qs:u8[16] | d * nib(i) + m |
| Q5_0 | 32 | 22 | d:f16, qh:u8[4], qs:u8[16] | d * ((nib(i) + 16 * bit i of qh) - 16) |
| Q5_1 | 32 | 24 | d:f16, m:f16, qh:u8[4], qs:u8[16] | d * (nib(i) + 16 * bit i of qh) + m |
| IQ4_NL | 32 | 18 | d:f16, qs:u8[16] | d * grid[nib(i)] |
| Q4_K | 256 | 144 | d:f16, dmin:f16, scales:u8[12], qs:u8[128] | d*sc[j] * q4 - dmin*mn[j] |
| Q5_K | 256 | 176 | d:f16, dmin:f16, scales:u8[12], qh:u8[32], qs:u8[128] | d*sc[j] * q5 - dmin*mn[j] |
| Q6_K | 256 | 210 | ql:u8[128], qh:u8[64], scales:int8[16], d:f16 | d*scales[i/16] * (q6 - 32) |
| IQ4_XS | 256 | 136 | d:f16, scales_h:u16, scales_l:u8[4], qs:u8[128] | d * (ls[j] - 32) * grid[nib] |
| Q2_K | 256 | 84 | scales:u8[16], qs:u8[64], d:f16, dmin:f16 | d*(sc & 15) * q2 - dmin*(sc >> 4) |
| Q3_K | 256 | 110 | hmask:u8[32], qs:u8[64], scales:u8[12], d:f16 | d*(sc - 32) * (q2 - 4 * !hbit) |
| F16 | 1 | 2 | an IEEE half | itself |
| BF16 | 1 | 2 | the top 16 bits of a float32 | itself |

- grid is ggml's kvalues_iq4nl (16 non-uniform int8 levels). IQ4_XS: eight sub-blocks j of
  32, each the nib() layout over its own 16 bytes of qs; ls[j] is a 6-bit scale, its low
  nibble in scales_l[j/2] (low nibble for even j), its top two bits at bits 2j of scales_h.
- Q2_K / Q3_K: sixteen sub-blocks of 16; in half h of 128 values, sub-block 8h + 2s + t holds
  bits 2s, 2s+1 of qs[32h + 16t + l]. Q3_K's third bit (set: no -4) is bit (4h + s) of
  hmask[16t + l]; its 6-bit scales: low nibbles of scales[0..7] then their high nibbles, top
  two bits from scales[8..11] (bits 2k of byte 8 + j % 4 for scale j, k = j / 4).
- 32-value formats: nib(i) is the low nibble of qs[i] for i < 16, the high nibble of qs[i-16]
  for i >= 16 (the first half of the block in the low nibbles).
- Q4_K / Q5_K: eight sub-blocks j of 32 values, each with a 6-bit scale sc[j] and a 6-bit
  min mn[j] packed into 12 bytes: for j < 4, sc = scales[j] & 63 and mn = scales[j+4] & 63;
  for j >= 4, sc = (scales[j+4] & 15) | (scales[j-4] >> 6) << 4 and
  mn = (scales[j+4] >> 4) | (scales[j] >> 6) << 4. The 4-bit values of sub-blocks 2c and 2c+1
  share qs[32c : 32c+32], low nibbles for 2c, high for 2c+1. Q5_K's fifth bit of value l in
  sub-block j is bit j of qh[l].
- Q6_K: two halves of 128 values; in half h, value 32t + l (t = 0..3, l = 0..31) takes the low
  (t < 2) or high (t >= 2) nibble of ql[64h + 32(t & 1) + l] and bits 2t, 2t+1 of
  qh[32h + l] as its top two bits; one int8 scale per 16 values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str  # lower case, as --quantize and the start-up lines spell it
    ggml_type: int  # GGMLQuantizationType's number: the native kernels are keyed by it
    values: int  # per block
    bytes: int  # per block
    dequantize: Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, bytes] -> float32 [n, values]
    scale_offsets: tuple[int, ...]  # where a block keeps its f16 scales (byte offsets)


class HeldBlocks:
    """What the rest of the engine asks of a block matrix, whichever layout holds its `blocks`:
    float32 activations and outputs, the device and the bytes of its blocks."""

    __slots__ = ()
    blocks: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


@dataclass(frozen=True, slots=True)
class QuantizedWeight(HeldBlocks):
    """A matrix [out, in] as GGUF blocks: `blocks` is uint8 [out, in / values * bytes], row n
    holding output feature n's blocks in order, byte for byte as the file stores them."""

    format: BlockFormat
    shape: tuple[int, int]  # (out_features, in_features)
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        out_features, in_features = self.shape
        if in_features % self.format.values:
            raise ValueError(f"{self.format.name} needs rows of whole {self.format.values}-value blocks; "
                             f"got {in_features} values")
        row_bytes = in_features // self.format.values * self.format.bytes
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != (out_features, row_bytes):
            raise ValueError(f"{self.format.name} {self.shape}: blocks must be uint8 [{out_features}, "
                             f"{row_bytes}], got {self.blocks.dtype} {list(self.blocks.shape)}")

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], computed as gguf.quants.dequantize does, bit for bit."""
        flat = self.blocks.reshape(-1, self.format.bytes)
        return self.format.dequantize(flat).reshape(self.shape)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The output features `index` (a permutation or selection), whole rows of blocks."""
        return QuantizedWeight(self.format, (len(index), self.shape[1]), self.blocks[index].contiguous())


@dataclass(frozen=True, slots=True)
class QuantizedStack:
    """Matrices stacked along the output features that do not share one block format (a
    Q4_K_M file keeps q and k in Q4_K, v in Q6_K): multiplied part by part, outputs side by side.
    A part may be a dense float32 matrix (a type with no kernel, dequantized at load)."""

    parts: tuple[QuantizedWeight | torch.Tensor, ...]  # or a kernel's repacked form of a part

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([dense(p) for p in self.parts])


Weight = torch.Tensor | QuantizedWeight | QuantizedStack


def serves_lookups(weight: object) -> bool:
    """A kernel's packed form of a token table that can still look rows up (`lookup(ids)`), so a
    tied table packed for the head need not be kept twice (nanoserve.native.repack)."""
    return callable(getattr(weight, "lookup", None))


class PackedBlocks(HeldBlocks):
    """A kernel's own layout of a block matrix (`nanoserve.native.repack`): the file's blocks,
    reordered for the kernel, still quantized."""

    __slots__ = ()


def is_quantized(weight: object) -> bool:
    return isinstance(weight, QuantizedWeight | QuantizedStack | PackedBlocks)


def dense(weight: Weight) -> torch.Tensor:
    """The weight as a float tensor (a dense one is returned as it is)."""
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


def format_names(weight: Weight) -> list[str]:
    """The block formats a weight holds ('float32' for a dense part), for cache keys and logs."""
    parts = weight.parts if isinstance(weight, QuantizedStack) else (weight,)
    return [p.format.name if isinstance(p, QuantizedWeight) else str(p.dtype).removeprefix("torch.")
            for p in parts]


def stack_rows(parts: list[Weight]) -> Weight:
    """Stack along the output features (q, k, v into one matrix): dense ones concatenate, rows
    of blocks of one format concatenate, and anything else becomes a QuantizedStack."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    if isinstance(first, QuantizedWeight) and all(
            isinstance(p, QuantizedWeight) and p.format == first.format for p in parts):
        return QuantizedWeight(first.format, (sum(p.shape[0] for p in parts), first.shape[1]),
                               torch.cat([p.blocks for p in parts]))
    flat = [q for p in parts for q in (p.parts if isinstance(p, QuantizedStack) else (p,))]
    return QuantizedStack(tuple(flat))


# ---- reference dequantizers: uint8 [n, bytes] -> float32 [n, values] --------------------------


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """u8 [n, k] -> [n, 2k]: the k low nibbles, then the k high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scale and min of each of the 8 sub-blocks, from 12 packed bytes: [n, 8] each."""
    low, high, mixed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mn = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_sub_block_values(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K 4-bit values [n, 8, 32]: each 32-byte group gives two sub-blocks."""
    groups = qs.reshape(-1, 4, 1, 32)
    return torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(-1, 8, 32)


def _k_dequantize(blocks: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * sc.float()).unsqueeze(-1)
    offset = (_f16(blocks, 2) * mn.float()).unsqueeze(-1)
    return (scale * values.float() - offset).reshape(-1, 256)


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_dequantize(blocks, _k_sub_block_values(blocks[:, 16:144]))


def _dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    qh = blocks[:, 16:48].unsqueeze(1)  # [n, 1, 32]
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high_bit = ((qh >> shifts) & 1) << 4  # [n, 8, 32]: bit j of qh[l] for sub-block j
    return _k_dequantize(blocks, _k_sub_block_values(blocks[:, 48:176]) | high_bit)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).to(torch.int8) - 32  # [n, 2, 4, 32]
    scale = _f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    return (scale.unsqueeze(-1) * q.reshape(-1, 16, 16).float()).reshape(-1, 256)



# IQ4_NL / IQ4_XS: each 4-bit code indexes this non-uniform grid (ggml-common.h kvalues_iq4nl).
_IQ4_GRID = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=torch.float32)


def _low_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """u8 [n, 4] (a little-endian uint32) -> its 32 bits [n, 32], bit j at j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(-1, 32)


def _dequantize_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _dequantize_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


def _dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 6:]) | (_low_high_bits(blocks[:, 2:6]) << 4)
    return _f16(blocks, 0) * (q.to(torch.int8) - 16).float()


def _dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 8:]) | (_low_high_bits(blocks[:, 4:8]) << 4)
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def _dequantize_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _IQ4_GRID[_nibbles(blocks[:, 2:]).long()]


def _iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS blocks [n, 136] -> each sub-block's 6-bit scale less 32, int32 [n, 8]."""
    high = blocks[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF  # [n, 1]
    low = blocks[:, 4:8]
    sub = torch.arange(8)
    return (((low[:, sub // 2].int() >> (4 * (sub % 2))) & 0xF) | (((high >> (2 * sub)) & 3) << 4)) - 32


def _dequantize_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    codes = _nibbles(blocks[:, 8:].reshape(-1, 8, 16))  # [n, 8, 32]
    scale = (_f16(blocks, 0) * _iq4_xs_scales(blocks).float()).unsqueeze(-1)
    return (scale * _IQ4_GRID[codes.long()]).reshape(-1, 256)


def _two_bit_groups(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K low bits: u8 [n, 64] -> [n, 16, 16], sub-block 8h + 2s + t holding bits 2s
    of qs[32h + 16t + l] (halves h of 128 values, shifts s, the two 16-byte runs t)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1, 1)
    runs = qs.reshape(-1, 2, 1, 2, 16)
    return ((runs >> shifts) & 3).reshape(-1, 16, 16)


def _dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, 0:16]
    scale = (_f16(blocks, 80) * (scales & 0xF).float()).unsqueeze(-1)
    offset = (_f16(blocks, 82) * (scales >> 4).float()).unsqueeze(-1)
    return (scale * _two_bit_groups(blocks[:, 16:80]).float() - offset).reshape(-1, 256)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's sixteen 6-bit scales from 12 bytes: low nibbles from bytes 0-7, two high bits
    each from bytes 8-11 (ggml's kmask1 / kmask2 unpacking), as int32 [n, 16]."""
    low = torch.cat([packed[:, 0:8] & 0xF, packed[:, 0:8] >> 4], dim=-1).int()  # [n, 16]
    top = packed[:, 8:12].int()
    high = torch.cat([(top >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)  # [n, 16]
    return low | (high << 4)


def _dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    hmask = blocks[:, 0:32]
    bits = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = ((hmask.unsqueeze(1) >> bits) & 1).reshape(-1, 16, 16)  # sub-block 2j + t: bit j of hmask[16t + l]
    q = _two_bit_groups(blocks[:, 32:96]).to(torch.int8) - 4 * (1 - high.to(torch.int8))
    scale = (_f16(blocks, 108) * (_q3_k_scales(blocks[:, 96:108]) - 32).float()).unsqueeze(-1)
    return (scale * q.float()).reshape(-1, 256)


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("q8_0", 8, 32, 34, _dequantize_q8_0, (0,)),
    BlockFormat("q4_0", 2, 32, 18, _dequantize_q4_0, (0,)),
    BlockFormat("q4_1", 3, 32, 20, _dequantize_q4_1, (0, 2)),
    BlockFormat("q4_k", 12, 256, 144, _dequantize_q4_k, (0, 2)),
    BlockFormat("q5_k", 13, 256, 176, _dequantize_q5_k, (0, 2)),
    BlockFormat("q6_k", 14, 256, 210, _dequantize_q6_k, (208,)),
    BlockFormat("q5_0", 6, 32, 22, _dequantize_q5_0, (0,)),
    BlockFormat("q5_1", 7, 32, 24, _dequantize_q5_1, (0, 2)),
    BlockFormat("iq4_nl", 20, 32, 18, _dequantize_iq4_nl, (0,)),
    BlockFormat("iq4_xs", 23, 256, 136, _dequantize_iq4_xs, (0,)),
    BlockFormat("q2_k", 10, 256, 84, _dequantize_q2_k, (80, 82)),
    BlockFormat("q3_k", 11, 256, 110, _dequantize_q3_k, (108,)),
    BlockFormat("f16", 1, 1, 2, _dequantize_f16, ()),
    BlockFormat("bf16", 30, 1, 2, _dequantize_bf16, ()),
)}
FORMATS_BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}


def random_weight(format_name: str, out_features: int, in_features: int, *,
                  generator: torch.Generator) -> QuantizedWeight:
    """Random blocks in `format_name` for tests and benchmarks: every bit pattern of the codes is
    a valid block, so the codes are random bytes, and each f16 scale is drawn from
    [-0.005, 0.015) (random bytes there would be NaN or huge); F16 / BF16 values are N(0, 1)."""
    fmt = FORMATS[format_name]
    if fmt.values == 1:
        dtype = torch.float16 if format_name == "f16" else torch.bfloat16
        values = torch.randn(out_features, in_features, generator=generator).to(dtype)
        return QuantizedWeight(fmt, (out_features, in_features), values.view(torch.uint8))
    count = out_features * in_features // fmt.values
    blocks = torch.randint(0, 256, (count, fmt.bytes), dtype=torch.uint8, generator=generator)
    for offset in fmt.scale_offsets:
        scales = (torch.rand(count, 1, generator=generator) * 0.02 - 0.005).half()
        blocks[:, offset : offset + 2] = scales.view(torch.uint8)
    return QuantizedWeight(fmt, (out_features, in_features), blocks.reshape(out_features, -1))


# ---- quantizers, for --quantize: float32 [out, in] -> QuantizedWeight -------------------------


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    # ggml's roundf, as gguf.quants computes it (floor(a + 0.5) rounds 0.49999997 up).
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _reciprocal_or_zero(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _quantize_q8_0(values: torch.Tensor) -> torch.Tensor:
    d = values.abs().amax(dim=-1, keepdim=True) / 127
    qs = _round_half_away(values * _reciprocal_or_zero(d)).to(torch.int8)
    return torch.cat([d.half().view(torch.uint8), qs.view(torch.uint8)], dim=-1)


def _quantize_q4_0(values: torch.Tensor) -> torch.Tensor:
    # The value of largest magnitude maps to -8, so its sign decides which end is exact.
    largest = values.gather(-1, values.abs().argmax(dim=-1, keepdim=True))
    d = largest / -8
    q = (values * _reciprocal_or_zero(d) + 8.5).trunc().to(torch.uint8).clamp(0, 15)
    return torch.cat([d.half().view(torch.uint8), q[:, :16] | (q[:, 16:] << 4)], dim=-1)


QUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "q8_0": _quantize_q8_0, "q4_0": _quantize_q4_0}


def quantize(weight: torch.Tensor, format_name: str) -> QuantizedWeight:
    """A float matrix [out, in] in `format_name` (one of QUANTIZERS), as llama.cpp quantizes it."""
    fmt = FORMATS[format_name]
    out_features, in_features = weight.shape
    if in_features % fmt.values:
        raise ValueError(f"{format_name} needs rows of whole {fmt.values}-value blocks; "
                         f"a row here has {in_features} values")
    blocks = QUANTIZERS[format_name](weight.float().reshape(-1, fmt.values))
    return QuantizedWeight(fmt, (out_features, in_features), blocks.reshape(out_features, -1).contiguous())
