"""The block formats csrc/gemm/matmul_more.c runs (Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K): the torch
reference against gguf's own code bit for bit, and against a float64 evaluation of
ggml-common.h's formula written out element by element here, on ragged shapes (row counts that
are no power of two, one block or several per row). The kernels themselves are held to a float64
product in test_quant.py, with every other format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from nanoserve.native.quant import MORE_FORMATS
from nanoserve.quant import FORMATS, FORMATS_BY_GGML_TYPE, random_weight

GRID = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
NAMES = ["iq4_nl", "iq4_xs", "q2_k", "q3_k", "q5_0", "q5_1"]


def fmt(name):
    return FORMATS[name]


def random_blocks(name: str, count: int, seed: int) -> torch.Tensor:
    weight = random_weight(name, count, fmt(name).values, generator=torch.Generator().manual_seed(seed))
    return weight.blocks


def f16(b: bytes, at: int) -> float:
    return float(np.frombuffer(b[at : at + 2], dtype=np.float16)[0])


def nib(qs: bytes, i: int) -> int:
    return qs[i] & 15 if i < 16 else qs[i - 16] >> 4


def scalar_block(name: str, b: bytes) -> list[float]:
    """One block's values in float64, element by element as ggml-common.h's layouts say."""
    if name in ("q5_0", "q5_1"):
        base = 2 if name == "q5_0" else 4
        qh, qs = int.from_bytes(b[base : base + 4], "little"), b[base + 4 :]
        q = [nib(qs, i) | ((qh >> i) & 1) << 4 for i in range(32)]
        if name == "q5_0":
            return [f16(b, 0) * (v - 16) for v in q]
        return [f16(b, 0) * v + f16(b, 2) for v in q]
    if name == "iq4_nl":
        return [f16(b, 0) * GRID[nib(b[2:], i)] for i in range(32)]
    if name == "iq4_xs":
        high, out = int.from_bytes(b[2:4], "little"), []
        for j in range(8):
            ls = (b[4 + j // 2] >> 4 * (j % 2)) & 15 | ((high >> 2 * j) & 3) << 4
            out += [f16(b, 0) * (ls - 32) * GRID[nib(b[8 + 16 * j : 24 + 16 * j], i)] for i in range(32)]
        return out
    out = []
    for h in range(2):
        for s in range(4):
            for t in range(2):
                sub = 8 * h + 2 * s + t
                for k in range(16):
                    q = (b[(16 if name == "q2_k" else 32) + 32 * h + 16 * t + k] >> 2 * s) & 3
                    if name == "q2_k":
                        sc = b[sub]
                        out.append(f16(b, 80) * (sc & 15) * q - f16(b, 82) * (sc >> 4))
                    else:
                        low = b[96 + sub] & 15 if sub < 8 else b[96 + sub - 8] >> 4
                        sc = low | ((b[104 + sub % 4] >> 2 * (sub // 4)) & 3) << 4
                        hbit = (b[16 * t + k] >> (4 * h + s)) & 1
                        out.append(f16(b, 108) * (sc - 32) * (q - (0 if hbit else 4)))
    return out


def test_every_format_is_named_and_numbered_as_ggml_does():
    assert set(NAMES) < MORE_FORMATS <= set(FORMATS)
    for ggml_type, f in FORMATS_BY_GGML_TYPE.items():
        assert GGMLQuantizationType(ggml_type).name.lower() == f.name
        assert GGMLQuantizationType(ggml_type) in GGML_QUANT_SIZES
        assert GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)] == (f.values, f.bytes)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("rows", "blocks_per_row"), [(1, 1), (7, 3), (33, 2)])
def test_reference_dequantizer_is_gguf_bit_for_bit_on_ragged_shapes(name, rows, blocks_per_row):
    blocks = random_blocks(name, rows * blocks_per_row, seed=rows)
    ours = fmt(name).dequantize(blocks).reshape(rows, -1)
    theirs = gguf_dequantize(blocks.reshape(rows, -1).numpy(), GGMLQuantizationType[name.upper()])
    assert np.array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("name", NAMES)
def test_reference_dequantizer_is_the_float64_formula_within_float32_rounding(name):
    blocks = random_blocks(name, 5, seed=11)
    ours = fmt(name).dequantize(blocks).double()
    expected = torch.tensor([scalar_block(name, bytes(row.tolist())) for row in blocks], dtype=torch.float64)
    # two float32 roundings (scale, then product or difference) on values below 0.01 * 128 * 16
    torch.testing.assert_close(ours, expected, rtol=2 ** -22, atol=2 ** -30)
