"""GGUF blocks repacked at load for csrc/gemm/matmul_x8.c: eight output columns interleaved per block.

Owns: `RepackedWeight` (the layout matmul_x8.c documents: per group of 8 output columns and
per 32-value block, the 8 scales side by side, then the codes in 4-byte chunks of each column
in turn), `repack` (a QuantizedWeight -> its repacked form, the file's bytes reordered; Q4_0
goes into the Q4_1 layout with m = -8 d, Q5_0 into Q5_1's with m = -16 d), `matmul` and
`lookup` (a tied head's table serving
the embedding's row lookups, so the table is resident once), each checked before a pointer
reaches C.
Also: `gemm`, the prefill GEMM over the Q4_1 and Q8_0 layouts (csrc/gemm/matmul_gemm.c, the same
bits as `matmul`; `has_gemm` says which), and `KRepackedWeight` / `repack_k` / `matmul_k`,
Q4_K, Q5_K, Q6_K, Q2_K, Q3_K and IQ4_XS in groups of 8 columns (csrc/gemm/matmul_kx8.c documents
those layouts; a tied table in them serves lookups too).
The repacking itself runs in C for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K (csrc/quant/repack.c: one pass, the
groups split among the threads), in torch for the others (`repack_torch`, `repack_k_torch`: every
format, the tests' reference for the C one).
Refuses: the formats it has no layout for (`repackable` and `k_repackable` say which: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS); the kernel choice leaves
those matrices in their file layout for matmul_quant.c / matmul_more.c.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from nanoserve import native
from nanoserve.quant import FORMATS, BlockFormat, PackedBlocks, QuantizedWeight

COLUMNS = 8  # csrc/gemm/matmul_x8.c's COLUMNS: output columns interleaved per group
# The layout each format is repacked into (a GGML type number: csrc/gemm/matmul_x8.c's X8_*).
LAYOUT = {"q4_0": FORMATS["q4_1"], "q4_1": FORMATS["q4_1"], "q5_0": FORMATS["q5_1"], "q5_1": FORMATS["q5_1"],
          "q8_0": FORMATS["q8_0"], "iq4_nl": FORMATS["iq4_nl"]}
# Formats held in another's layout with the offset m = -SHIFT * d (exact in f16 unless it overflows).
SHIFTED = {"q4_0": 8, "q5_0": 16}
GEMM_LAYOUTS = ("q4_1", "q8_0")  # the layouts csrc/gemm/matmul_gemm.c runs
NATIVE_REPACKS = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")  # the formats csrc/quant/repack.c repacks
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class RepackedWeight(PackedBlocks):
    """A matrix [out, in] in matmul_x8.c's layout: `blocks` is uint8 [groups, in / 32 *
    8 * layout.bytes], group g holding output features 8g..8g+7 (zero columns past `out`)."""

    source: BlockFormat  # the file's format
    layout: BlockFormat  # the block format the groups hold (Q4_0 is held as Q4_1, Q5_0 as Q5_1)
    shape: tuple[int, int]  # (out_features, in_features)
    blocks: torch.Tensor

    def lookup(self, ids: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
        """Rows `ids` as float32 [*ids.shape, in] (a tied token table's embedding lookups)."""
        return lookup(self, ids, threads=threads)


def repackable(weight: object) -> bool:
    return isinstance(weight, QuantizedWeight) and weight.format.name in LAYOUT


def has_gemm(weight: object) -> bool:
    return isinstance(weight, RepackedWeight) and weight.layout.name in GEMM_LAYOUTS


def repack(weight: QuantizedWeight, *, threads: int | None = None) -> RepackedWeight | QuantizedWeight:
    """`weight` in the interleaved layout; itself where there is no layout for its format (or
    Q4_0 / Q5_0 with a scale too large for m = -8 d / -16 d in f16). Q4_0, Q4_1 and Q8_0 are
    repacked in C (csrc/quant/repack.c, on `threads` threads) where the library runs, the others by
    `repack_torch`."""
    if not repackable(weight):
        return weight
    if weight.format.name in NATIVE_REPACKS and _lib() is not None:
        blocks = _native_repack(weight, weight.shape[1] // 32, threads)
        return weight if blocks is None else RepackedWeight(weight.format, LAYOUT[weight.format.name],
                                                            weight.shape, blocks)
    return repack_torch(weight)


def _native_repack(weight: QuantizedWeight, blocks_per_row: int, threads: int | None) -> torch.Tensor | None:
    """csrc/quant/repack.c's layout of `weight`: uint8 [groups, blocks_per_row x group-block bytes], or
    None where a Q4_0 scale's offset overflows f16."""
    lib = _require()
    groups = -(-weight.shape[0] // COLUMNS)
    out = torch.empty(groups, blocks_per_row * lib.ns_repack_group_block_bytes(weight.format.ggml_type),
                      dtype=torch.uint8)
    source = weight.blocks.contiguous()
    status = lib.ns_repack_blocks(weight.format.ggml_type, source.data_ptr(), out.data_ptr(), weight.shape[0],
                                  weight.shape[1], native.thread_count(threads))
    if status == -4:
        return None
    if status != 0:
        raise ValueError(f"the native library refused to repack {weight.format.name} {weight.shape}")
    return out


def repack_torch(weight: QuantizedWeight) -> RepackedWeight | QuantizedWeight:
    """`repack` in torch, for every format with a layout (the tests' reference for csrc/quant/repack.c)."""
    if not repackable(weight):
        return weight
    out_features, in_features = weight.shape
    blocks = weight.blocks.reshape(out_features, in_features // 32, weight.format.bytes)
    if weight.format.name in SHIFTED:
        d = blocks[..., :2].contiguous()
        m = (d.view(torch.float16) * -SHIFTED[weight.format.name]).contiguous()
        if not torch.isfinite(m).all():
            return weight
        blocks = torch.cat([d, m.view(torch.uint8), blocks[..., 2:]], dim=-1)
    layout = LAYOUT[weight.format.name]
    if layout.name == "q5_1":  # d, m, then the fifth bits regrouped by chunk, then the low 4 bits
        blocks = torch.cat([blocks[..., :4], _fifth_bits(blocks[..., 4:8]), blocks[..., 8:]], dim=-1)
    scale_bytes = 2 if layout.name in ("q8_0", "iq4_nl") else 4  # d alone, or d and m
    padded = torch.zeros(-(-out_features // COLUMNS) * COLUMNS, *blocks.shape[1:], dtype=torch.uint8)
    padded[:out_features] = blocks
    groups = padded.view(-1, COLUMNS, *blocks.shape[1:])  # [group, column, block, bytes]
    count, _, per_row, _ = groups.shape
    # -> [group, block, field, column, 2]: the columns' d side by side, then their m
    scales = groups[..., :scale_bytes].reshape(count, COLUMNS, per_row, -1, 2).permute(0, 2, 3, 1, 4)
    # -> [group, block, chunk, column, 4]: 4 code bytes of each column in turn (Q5_1: its 4 bytes
    # of fifth bits are one chunk of its own)
    codes = groups[..., scale_bytes:].reshape(count, COLUMNS, per_row, -1, 4).permute(0, 2, 3, 1, 4)
    packed = torch.cat([scales.reshape(count, per_row, -1), codes.reshape(count, per_row, -1)], dim=-1)
    return RepackedWeight(weight.format, layout, weight.shape, packed.reshape(count, -1).contiguous())


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5 blocks' qh [..., 4] (bit i: value i's fifth bit) -> [..., 4] in matmul_x8.c's order:
    byte i holds at bit t value 4t + i's fifth bit, at bit 4 + t value 16 + 4t + i's."""
    bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [..., byte, bit]
    bits = bits.reshape(*qh.shape[:-1], 2, 4, 4)  # value 16h + 4t + i -> [.., h, t, i]
    weights = (1 << (torch.arange(4).view(1, 4, 1) + 4 * torch.arange(2).view(2, 1, 1))).to(torch.uint8)
    return (bits * weights).sum(dim=(-3, -2), dtype=torch.uint8)  # disjoint bits: the sum is an OR


PRODUCTS = ("ns_matmul_x8", "ns_gemm_x8", "ns_matmul_kx8")  # each with a `_portable` twin
# The x8 and K layouts' products on an ISA named by the caller (nanoserve.native.ISAS)
ISA_PRODUCTS = ("ns_matmul_x8_isa", "ns_matmul_kx8_isa")
LOOKUPS = ("ns_dequantize_rows_x8", "ns_dequantize_rows_kx8")  # rows of matmul_x8.c's, matmul_kx8.c's layouts


@functools.cache
def _lib() -> ctypes.CDLL | None:
    loaded = native.library()
    if loaded is None:
        return None
    lib = loaded.lib
    for name in PRODUCTS:  # x8 GEMV tiles, the prefill GEMM, the K layouts: one signature
        for entry in (getattr(lib, name), getattr(lib, f"{name}_portable")):
            entry.argtypes = [ctypes.c_int, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int]
            entry.restype = ctypes.c_int
    for name in ISA_PRODUCTS:
        getattr(lib, name).argtypes = [ctypes.c_int, ctypes.c_int, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int
    lib.ns_repack_blocks.argtypes = [ctypes.c_int, _P, _P, _I64, _I64, ctypes.c_int]
    lib.ns_repack_blocks.restype = lib.ns_repack_group_block_bytes.restype = ctypes.c_int
    lib.ns_repack_group_block_bytes.argtypes = [ctypes.c_int]
    for name in LOOKUPS:
        getattr(lib, name).argtypes = [ctypes.c_int, _P, _P, _I64, _I64, _I64, _P, ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _require() -> ctypes.CDLL:
    lib = _lib()
    if lib is None:
        raise RuntimeError(native.status())
    return lib


def matmul(x: torch.Tensor, weight: RepackedWeight, *, portable: bool = False, isa: str | None = None,
           threads: int | None = None) -> torch.Tensor:
    """x [rows, in] float32 @ weight^T -> float32 [rows, out]. `portable` runs the plain C path
    (for the tests: it gives the vector path's bits); `isa` one of nanoserve.native.ISAS that
    runs here (every one gives the same bits); `threads` None: `native.thread_count`'s."""
    what = f"{weight.source.name} {weight.shape} repacked"
    if isa is not None:
        return _product_on(isa, "ns_matmul_x8_isa", weight.layout.ggml_type, x, weight.blocks, weight.shape,
                           what, threads)
    return _product("ns_matmul_x8", portable, weight.layout.ggml_type, x, weight.blocks, weight.shape, what,
                    threads)


def _product_on(isa: str, name: str, ggml_type: int, x: torch.Tensor, blocks: torch.Tensor,
                shape: tuple[int, int], what: str, threads: int | None) -> torch.Tensor:
    """One of ISA_PRODUCTS on ISA `isa`."""
    lib = _require()
    if isa not in native.ISAS:
        raise ValueError(f"isa: {isa!r} is not one of {', '.join(native.ISAS)}")
    x, y = _checked(x, shape)
    if x.shape[0]:
        status = getattr(lib, name)(native.ISAS.index(isa), ggml_type, x.data_ptr(), blocks.data_ptr(),
                                    y.data_ptr(), x.shape[0], shape[0], shape[1],
                                    native.thread_count(threads))
        if status == -1:
            raise ValueError(f"isa: {isa} does not run here, or {what} has no layout")
        native.raise_for_status(status, "repacked matmul", what, shape[0])
    return y


def _product(name: str, portable: bool, ggml_type: int, x: torch.Tensor, blocks: torch.Tensor,
             shape: tuple[int, int], what: str, threads: int | None) -> torch.Tensor:
    """One of PRODUCTS (or its scalar reference) over x [rows, in] and a layout's `blocks`."""
    lib = _require()
    x, y = _checked(x, shape)
    if x.shape[0]:
        entry = getattr(lib, f"{name}_portable" if portable else name)
        status = entry(ggml_type, x.data_ptr(), blocks.data_ptr(), y.data_ptr(), x.shape[0], shape[0],
                       shape[1], native.thread_count(threads))
        native.raise_for_status(status, "repacked matmul", what, shape[0])
    return y


def lookup(weight: RepackedWeight | KRepackedWeight, ids: torch.Tensor, *,
           threads: int | None = None) -> torch.Tensor:
    """Rows `ids` of either layout, dequantized: float32 [*ids.shape, in]."""
    lib = _require()
    if isinstance(weight, KRepackedWeight):
        entry, ggml_type, source = lib.ns_dequantize_rows_kx8, weight.format.ggml_type, weight.format
    else:
        entry, ggml_type, source = lib.ns_dequantize_rows_x8, weight.layout.ggml_type, weight.source
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), weight.shape[1], dtype=torch.float32)
    if flat.numel():
        status = entry(ggml_type, weight.blocks.data_ptr(), flat.data_ptr(), flat.numel(), weight.shape[0],
                       weight.shape[1], out.data_ptr(), native.thread_count(threads))
        what = f"{source.name} {weight.shape} repacked"
        native.raise_for_status(status, "repacked matmul", what, weight.shape[0])
    return out.reshape(*ids.shape, weight.shape[1])


# ---- the prefill GEMM (csrc/gemm/matmul_gemm.c) over the same layouts ----------------------------

def gemm(x: torch.Tensor, weight: RepackedWeight, *, portable: bool = False,
         threads: int | None = None) -> torch.Tensor:
    """`matmul`'s product, bit for bit, by the register-blocked GEMM for prompt chunks (many
    rows); `portable` runs its scalar reference."""
    return _product("ns_gemm_x8", portable, weight.layout.ggml_type, x, weight.blocks, weight.shape,
                    f"{weight.source.name} {weight.shape} repacked", threads)


def _checked(x: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x made contiguous, and an empty float32 output, once x is known to multiply [out, in]."""
    out_features, in_features = shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features or x.device.type != "cpu":
        raise ValueError(f"x must be float32 [rows, {in_features}] on the CPU; got {x.dtype} "
                         f"{list(x.shape)} on {x.device}")
    return x.contiguous(), torch.empty(x.shape[0], out_features, dtype=torch.float32)


# ---- the K-quants and IQ4_XS in groups of 8 columns (csrc/gemm/matmul_kx8.c) --------------------------

# Per group of 8 columns and super-block of 256.
K_LAYOUT_BYTES = {"q4_k": 1184, "q5_k": 1440, "q6_k": 2192, "q2_k": 672, "q3_k": 912, "iq4_xs": 1104}


@dataclass(frozen=True, slots=True)
class KRepackedWeight(PackedBlocks):
    """A Q4_K, Q5_K, Q6_K, Q2_K, Q3_K or IQ4_XS matrix [out, in] in matmul_kx8.c's layout: `blocks`
    is uint8 [groups, in / 256 * K_LAYOUT_BYTES[format]], group g holding output features
    8g..8g+7 (zero columns past `out`). Its values are the file's (`dequantize` gives them back)."""

    format: BlockFormat
    shape: tuple[int, int]
    blocks: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], read back from the layout alone (what the tests hold against the
        file's reference dequantizer)."""
        return _k_dequantize_layout(self)

    def lookup(self, ids: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
        """Rows `ids` as float32 [*ids.shape, in] (a tied token table's embedding lookups)."""
        return lookup(self, ids, threads=threads)


def k_repackable(weight: object) -> bool:
    return isinstance(weight, QuantizedWeight) and weight.format.name in K_LAYOUT_BYTES


def repack_k(weight: QuantizedWeight, *, threads: int | None = None) -> KRepackedWeight | QuantizedWeight:
    """`weight` in matmul_kx8.c's layout; itself where its format is not in K_LAYOUT_BYTES. Q4_K and
    Q6_K are repacked in C (csrc/quant/repack.c, on `threads` threads) where the library runs, the others
    by `repack_k_torch`."""
    if k_repackable(weight) and weight.format.name in NATIVE_REPACKS and _lib() is not None:
        blocks = _native_repack(weight, weight.shape[1] // 256, threads)
        return KRepackedWeight(weight.format, weight.shape, blocks)
    return repack_k_torch(weight)


def repack_k_torch(weight: QuantizedWeight) -> KRepackedWeight | QuantizedWeight:
    """`repack_k` in torch, for every K layout (the tests' reference for csrc/quant/repack.c)."""
    if not k_repackable(weight):
        return weight
    out_features, in_features = weight.shape
    blocks = weight.blocks.reshape(out_features, in_features // 256, weight.format.bytes)
    padded = torch.zeros(-(-out_features // COLUMNS) * COLUMNS, *blocks.shape[1:], dtype=torch.uint8)
    padded[:out_features] = blocks
    groups = padded.view(-1, COLUMNS, *blocks.shape[1:])  # [group, column, super-block, bytes]
    fields = _K_FIELDS[weight.format.name](groups)
    packed = torch.cat(fields, dim=-1)  # [group, super-block, layout bytes]
    return KRepackedWeight(weight.format, weight.shape, packed.reshape(packed.shape[0], -1).contiguous())


def _per_column(field: torch.Tensor) -> torch.Tensor:
    """[group, column, super-block, entries(, bytes)] -> [group, super-block, entry-major bytes]:
    each entry's 8 columns side by side."""
    moved = field.movedim(1, 3) if field.dim() == 5 else field.movedim(1, -1)
    return moved.reshape(field.shape[0], field.shape[2], -1)


def _chunked(codes: torch.Tensor) -> torch.Tensor:
    """Code bytes [group, column, super-block, sets, bytes] -> [group, super-block, sets * 8 *
    bytes]: per set, chunk t holds each column's bytes 4t..4t+3 in turn."""
    g, _, s, sets, _ = codes.shape
    return codes.reshape(g, COLUMNS, s, sets, -1, 4).permute(0, 2, 3, 4, 1, 5).reshape(g, s, -1)


def _nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [group, column, super-block, 8, 32] -> bytes [.., 4, 32]: sub-block 2p low, 2p+1 high."""
    pairs = codes.reshape(*codes.shape[:3], 4, 2, 32)
    return pairs[..., 0, :] | (pairs[..., 1, :] << 4)


def _q4_k_fields(groups: torch.Tensor, codes_at: int = 16) -> list[torch.Tensor]:
    """Q4_K's fields, or Q5_K's but its fifth bits (its 128 bytes of low nibbles at `codes_at`)."""
    from nanoserve.quant import _k_scales_mins, _k_sub_block_values

    g, _, s, width = groups.shape
    flat = groups.reshape(-1, width)
    sc, mn = (t.reshape(g, COLUMNS, s, 8) for t in _k_scales_mins(flat[:, 4:16]))
    codes = _k_sub_block_values(flat[:, codes_at : codes_at + 128]).reshape(g, COLUMNS, s, 8, 32)
    return [_per_column(groups[..., 0:2].reshape(g, COLUMNS, s, 1, 2)),
            _per_column(groups[..., 2:4].reshape(g, COLUMNS, s, 1, 2)),
            _per_column(sc), _per_column(mn), _chunked(_nibble_pairs(codes))]


def _q5_k_fields(groups: torch.Tensor) -> list[torch.Tensor]:
    """Q4_K's fields from the low 4 bits (qs at 48), then the file's qh chunked."""
    g, _, s, _ = groups.shape
    return [*_q4_k_fields(groups, codes_at=48), _chunked(groups[..., 16:48].reshape(g, COLUMNS, s, 1, 32))]


def _q6_k_codes(flat: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, 210] -> codes [n, 8, 32] in 0..63 (quant.py's docstring, before the -32)."""
    ql = flat[:, 0:128].reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)
    qh = flat[:, 128:192].reshape(-1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    return (low | (((qh >> shifts) & 3) << 4)).reshape(-1, 8, 32)


def _q6_k_fields(groups: torch.Tensor) -> list[torch.Tensor]:
    g, _, s, _ = groups.shape
    codes = _q6_k_codes(groups.reshape(-1, 210)).reshape(g, COLUMNS, s, 8, 32)
    return [_per_column(groups[..., 208:210].reshape(g, COLUMNS, s, 1, 2)),
            _per_column(groups[..., 192:208]), _chunked(codes)]


def _iq4_xs_fields(groups: torch.Tensor) -> list[torch.Tensor]:
    from nanoserve.quant import _iq4_xs_scales

    g, _, s, _ = groups.shape
    scales = _iq4_xs_scales(groups.reshape(-1, 136)).to(torch.int8).view(torch.uint8)
    return [_per_column(groups[..., 0:2].reshape(g, COLUMNS, s, 1, 2)),
            _per_column(scales.reshape(g, COLUMNS, s, 8)),
            _chunked(groups[..., 8:136].reshape(g, COLUMNS, s, 8, 16))]


def _q2_k_fields(groups: torch.Tensor) -> list[torch.Tensor]:
    g, _, s, _ = groups.shape
    return [_per_column(groups[..., 80:82].reshape(g, COLUMNS, s, 1, 2)),
            _per_column(groups[..., 82:84].reshape(g, COLUMNS, s, 1, 2)),
            _per_column(groups[..., 0:16]), _chunked(groups[..., 16:80].reshape(g, COLUMNS, s, 2, 32))]


def _q3_k_fields(groups: torch.Tensor) -> list[torch.Tensor]:
    from nanoserve.quant import _q3_k_scales, _two_bit_groups

    g, _, s, _ = groups.shape
    flat = groups.reshape(-1, 110)
    scales = (_q3_k_scales(flat[:, 96:108]) - 32).to(torch.int8).view(torch.uint8)
    bits = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = ((flat[:, 0:32].unsqueeze(1) >> bits) & 1).reshape(-1, 16, 16)  # as quant.py's dequantizer reads
    w = (_two_bit_groups(flat[:, 32:96]) | (high << 2)).reshape(g, COLUMNS, s, 8, 32)  # q + 4 in 0..7
    planes = [w[..., 0, :] | (w[..., 1, :] << 3) | ((w[..., 6, :] & 3) << 6),
              w[..., 2, :] | (w[..., 3, :] << 3) | ((w[..., 7, :] & 3) << 6),
              w[..., 4, :] | (w[..., 5, :] << 3) | ((w[..., 6, :] >> 2) << 6) | ((w[..., 7, :] >> 2) << 7)]
    return [_per_column(groups[..., 108:110].reshape(g, COLUMNS, s, 1, 2)),
            _per_column(scales.reshape(g, COLUMNS, s, 16)), _chunked(torch.stack(planes, dim=3))]


# Each format's fields of a group-super-block in layout order, from the file's blocks
# [group, column, super-block, bytes].
_K_FIELDS = {"q4_k": _q4_k_fields, "q5_k": _q5_k_fields, "q6_k": _q6_k_fields, "q2_k": _q2_k_fields,
             "q3_k": _q3_k_fields, "iq4_xs": _iq4_xs_fields}


def _k_dequantize_layout(weight: KRepackedWeight) -> torch.Tensor:
    """The layout's values as float32 [out, in], by matmul_kx8.c's own reading of it."""
    out_features, in_features = weight.shape
    s = in_features // 256
    blocks = weight.blocks.reshape(-1, s, K_LAYOUT_BYTES[weight.format.name])
    g = blocks.shape[0]

    def columns(start: int, entries: int, width: int = 1) -> torch.Tensor:  # [g, column, s, entries, width]
        field = blocks[..., start : start + entries * COLUMNS * width].reshape(g, s, entries, COLUMNS, width)
        return field.permute(0, 3, 1, 2, 4)

    def unchunked(start: int, sets: int, width: int = 32) -> torch.Tensor:  # -> [g, column, s, sets, width]
        field = blocks[..., start : start + COLUMNS * width * sets]
        field = field.reshape(g, s, sets, width // 4, COLUMNS, 4)
        return field.permute(0, 4, 1, 2, 3, 5).reshape(g, COLUMNS, s, sets, width)

    def f16(start: int) -> torch.Tensor:  # -> [g, column, s, 1]
        return columns(start, 1, 2).contiguous().view(torch.float16).float().reshape(g, COLUMNS, s, 1)

    def low_nibbles(start: int) -> torch.Tensor:  # -> [g, column, s, 8, 32]
        pairs = unchunked(start, 4)
        return torch.stack([pairs & 0x0F, pairs >> 4], dim=4).reshape(g, COLUMNS, s, 8, 32)

    if weight.format.name == "iq4_xs":
        from nanoserve.quant import _IQ4_GRID, _nibbles

        ls = columns(16, 8).squeeze(-1).contiguous().view(torch.int8).float()  # [g, column, s, 8]
        codes = _nibbles(unchunked(80, 8, 16))  # [g, column, s, 8, 32]
        values = (f16(0) * ls).unsqueeze(-1) * _IQ4_GRID[codes.long()]
    elif weight.format.name in ("q4_k", "q5_k"):
        codes = low_nibbles(160)
        if weight.format.name == "q5_k":
            bits = torch.arange(8, dtype=torch.uint8).view(1, 1, 1, 8, 1)
            codes = codes | (((unchunked(1184, 1) >> bits) & 1) << 4)
        sc, mn = columns(32, 8).squeeze(-1).float(), columns(96, 8).squeeze(-1).float()
        values = (f16(0) * sc).unsqueeze(-1) * codes.float() - (f16(16) * mn).unsqueeze(-1)
    elif weight.format.name == "q2_k":
        scales = columns(32, 16).squeeze(-1)  # [g, column, s, 16]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 1, 4, 1)
        codes = ((unchunked(160, 2).unsqueeze(4) >> shifts) & 3).reshape(g, COLUMNS, s, 16, 16)
        values = ((f16(0) * (scales & 0xF).float()).unsqueeze(-1) * codes.float()
                  - (f16(16) * (scales >> 4).float()).unsqueeze(-1))
    elif weight.format.name == "q3_k":
        p0, p1, p2 = unchunked(144, 3).unbind(3)  # [g, column, s, 32] each
        w = torch.stack([p0 & 7, (p0 >> 3) & 7, p1 & 7, (p1 >> 3) & 7, p2 & 7, (p2 >> 3) & 7,
                         (p0 >> 6) | (((p2 >> 6) & 1) << 2), (p1 >> 6) | ((p2 >> 7) << 2)], dim=3)
        codes = w.reshape(g, COLUMNS, s, 16, 16).to(torch.int8) - 4
        scales = columns(16, 16).squeeze(-1).contiguous().view(torch.int8).float()
        values = (f16(0) * scales).unsqueeze(-1) * codes.float()
    else:
        codes = unchunked(144, 8).to(torch.int8) - 32
        scales = columns(16, 16).squeeze(-1).contiguous().view(torch.int8).float()  # [g, column, s, 16]
        values = (f16(0) * scales).unsqueeze(-1) * codes.reshape(g, COLUMNS, s, 16, 16).float()
    return values.reshape(g * COLUMNS, in_features)[:out_features]


def matmul_k(x: torch.Tensor, weight: KRepackedWeight, *, portable: bool = False, isa: str | None = None,
             threads: int | None = None) -> torch.Tensor:
    """x [rows, in] float32 @ weight^T -> float32 [rows, out]; `portable` runs the scalar reference,
    `isa` one of nanoserve.native.ISAS that runs here (every one gives the same bits)."""
    what = f"{weight.format.name} {weight.shape} repacked"
    if isa is not None:
        return _product_on(isa, "ns_matmul_kx8_isa", weight.format.ggml_type, x, weight.blocks, weight.shape,
                           what, threads)
    return _product("ns_matmul_kx8", portable, weight.format.ggml_type, x, weight.blocks, weight.shape, what,
                    threads)
