"""The block tiles on every ISA this CPU runs (csrc/runtime/isa.h, csrc/arch/x86/wide_tiles.h): each ISA
path gives the portable reference's bits on ragged shapes (rows 1..17, 33 and 130; N odd, below
one group, an odd number of groups and a multiple of 16 columns), at the extremes of the codes,
on any thread count, and a row's bits never depend on the rows beside it; the start-up line
names the ISA the tiles run on."""

from __future__ import annotations

import os

import pytest
import torch
from test_quant import assert_within_bound, random_weight

from nanoserve import native
from nanoserve.quant import QuantizedWeight

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")

ROW_COUNTS = (*range(1, 18), 33, 130)
# N: below one group, odd, an odd number of groups (a short unit of two), a multiple of 16
X8_SHAPES = [(5, 64), (37, 96), (24, 160), (48, 64)]
K_SHAPES = [(5, 256), (37, 512), (24, 256), (48, 768)]
X8_FORMATS = ("q4_0", "q4_1", "q8_0", "q5_1", "iq4_nl")  # the last two have no wide tile: AVX2's runs
K_FORMATS = ("q4_k", "q6_k", "q5_k", "iq4_xs")
ALL_ISAS = ("avx2", "avxvnni", "avx512", "avx512vnni")


def _repack():
    from nanoserve.native import repack

    return repack


def _isas_here() -> list[str]:
    library = native.library()
    return [] if library is None else [isa for isa in library.isas() if isa != "portable"]


def _isa_param(isa: str):
    lacking = pytest.mark.skipif(isa not in _isas_here(), reason=f"this CPU lacks {isa}")
    return pytest.param(isa, marks=lacking)


ISAS = [_isa_param(isa) for isa in ALL_ISAS]


def _product(weight: QuantizedWeight):
    """(packed, product(x, packed, **how)) for weight's layout."""
    repack = _repack()
    if weight.format.name in K_FORMATS:
        return repack.repack_k(weight), repack.matmul_k
    return repack.repack(weight), repack.matmul


def assert_isa_gives_the_references_bits(weight: QuantizedWeight, isa: str, x: torch.Tensor) -> None:
    packed, product = _product(weight)
    alone = torch.cat([product(x[r : r + 1], packed, isa=isa) for r in range(x.shape[0])])
    for rows in ROW_COUNTS:
        if rows > x.shape[0]:
            continue
        y = product(x[:rows], packed, isa=isa)
        assert torch.equal(y, product(x[:rows], packed, portable=True)), f"{isa}: {rows} rows"
        assert torch.equal(y, alone[:rows]), f"{isa}: {rows} rows against each row alone"
    assert_within_bound(y, x[:rows], weight)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("format_name", X8_FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), X8_SHAPES)
def test_each_isa_gives_the_portable_bits_on_the_x8_layouts(isa, format_name, out_features, in_features):
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(out_features))
    weight = random_weight(format_name, out_features, in_features, seed=in_features)
    assert_isa_gives_the_references_bits(weight, isa, x)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("format_name", K_FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), K_SHAPES)
def test_each_isa_gives_the_portable_bits_on_the_k_layouts(isa, format_name, out_features, in_features):
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(out_features))
    weight = random_weight(format_name, out_features, in_features, seed=in_features)
    assert_isa_gives_the_references_bits(weight, isa, x)


# (format, byte ranges of each file block set to a value): codes and scales at their extremes
EXTREMES = [
    ("q4_0", [(slice(2, 18), 0xFF)]),  # codes at 15 (value 7)
    ("q4_0", [(slice(2, 18), 0x00)]),  # codes at 0 (value -8)
    ("q8_0", [(slice(2, 34), 0x81)]),  # codes at -127: |pair| = 2 x 127 x 127
    ("q8_0", [(slice(2, 34), 0x7F)]),  # codes at 127
    ("q4_k", [(slice(16, 144), 0xFF), (slice(4, 16), 0xFF)]),  # codes at 15, scales and mins at 63
    ("q6_k", [(slice(0, 192), 0xFF), (slice(192, 208), 0x7F)]),  # codes at 63 (q - 32 = 31), scales 127
    ("q6_k", [(slice(0, 192), 0x00), (slice(192, 208), 0x80)]),  # codes at 0 (q - 32 = -32), scales -128
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("format_name", "extremes"), EXTREMES)
def test_extreme_codes_and_scales_give_the_portable_bits_on_each_isa(isa, format_name, extremes):
    """Every activation code at +-127 against codes and scales at their bounds: the integer sums
    sit at their limits, and the ISA path must still give the scalar reference's bits."""
    x = torch.full((5, 512), 1.0)
    x[3:] = -1.0
    x[2, ::2] = -1.0
    weight = random_weight(format_name, 19, 512)
    blocks = weight.blocks.reshape(-1, weight.format.bytes).clone()
    for byte_range, value in extremes:
        blocks[:, byte_range] = value
    extreme = QuantizedWeight(weight.format, weight.shape, blocks.reshape(19, -1))
    packed, product = _product(extreme)
    y = product(x, packed, isa=isa)
    assert torch.equal(y, product(x, packed, portable=True))
    assert_within_bound(y, x, extreme)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("format_name", ["q4_0", "q6_k"])
def test_each_isas_bits_do_not_depend_on_the_thread_count(isa, format_name):
    weight = random_weight(format_name, 203, 768)
    packed, product = _product(weight)
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(3))
    one = product(x, packed, isa=isa, threads=1)
    for threads in (2, 3):
        assert torch.equal(product(x, packed, isa=isa, threads=threads), one), f"{threads} threads"


def test_an_isa_this_cpu_lacks_or_an_unknown_name_is_refused():
    packed = _repack().repack(random_weight("q4_0", 8, 64))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="isa"):
        _repack().matmul(x, packed, isa="sse9")
    for lacking in set(ALL_ISAS) - set(_isas_here()):
        with pytest.raises(ValueError, match=f"isa: {lacking} does not run here"):
            _repack().matmul(x, packed, isa=lacking)


def test_the_start_up_line_names_the_isa_the_tiles_run_on():
    library = native.library()
    # isa.h: AVX-512 without VNNI runs only when named; NANOSERVE_ISA names one that runs here
    chosen_by_default = [isa for isa in _isas_here() if isa != "avx512"]
    named = os.environ.get(native.ISA_VARIABLE, "").strip()
    expected = (named if named in library.isas() else
                chosen_by_default[-1] if chosen_by_default else "portable")
    assert library.tiles_isa == expected
    assert f"tiles on {library.tiles_isa}" in native.status()
    # the float panels follow the tiles' choice: AVX-512's pair tiles on either AVX-512 level
    wide = library.tiles_isa in ("avx512", "avx512vnni")
    panels = "avx512" if wide else "avx2" if "avx2" in _isas_here() else "portable"
    assert native.float_panels_isa(library) == panels
    assert f"float panels on {panels}" in native.status()


# ---- the repacking at load in C (csrc/quant/repack.c) against the torch reference ----------------------

@pytest.mark.parametrize("format_name", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("out_features", [1, 7, 8, 37])
def test_the_c_repack_writes_the_torch_repacks_bytes(format_name, out_features):
    repack = _repack()
    in_features = 512
    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    if format_name in K_FORMATS:
        native, reference = repack.repack_k(weight), repack.repack_k_torch(weight)
    else:
        native, reference = repack.repack(weight), repack.repack_torch(weight)
    assert torch.equal(native.blocks, reference.blocks)


def test_q4_0_scales_at_the_f16_edges_get_the_torch_repacks_offsets_or_stay_in_the_file():
    repack = _repack()
    weight = random_weight("q4_0", 16, 64)
    blocks = weight.blocks.clone().reshape(-1, 18)
    # +-0, subnormals that stay subnormal and that become normal, and the largest normal that
    # does not overflow (8188 x 8 = 65504)
    scales = torch.tensor([0.0, -0.0, 2.0**-24, -(2.0**-20), 2.0**-17, 1.5 * 2.0**-15, 8188.0, -8188.0],
                          dtype=torch.float16)
    blocks[: len(scales), :2] = scales.view(torch.uint8).reshape(-1, 2)
    edged = QuantizedWeight(weight.format, weight.shape, blocks.reshape(16, -1))
    assert torch.equal(repack.repack(edged).blocks, repack.repack_torch(edged).blocks)
    for overflowing in (8192.0, float("inf"), float("nan")):
        blocks[0, :2] = torch.tensor([overflowing], dtype=torch.float16).view(torch.uint8)
        held = QuantizedWeight(weight.format, weight.shape, blocks.reshape(16, -1).clone())
        assert repack.repack(held) is held and repack.repack_torch(held) is held


def test_a_benchmark_can_switch_the_tiles_isa_between_calls_and_back():
    repack = _repack()
    packed = repack.repack(random_weight("q4_0", 40, 256))
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    chosen = native.library().tiles_isa
    expected = repack.matmul(x, packed, portable=True)
    for isa in _isas_here():
        before = native.choose_tiles_isa(isa)
        try:
            assert torch.equal(repack.matmul(x, packed), expected), isa
        finally:
            native.choose_tiles_isa(before)
    assert native.choose_tiles_isa(chosen) == chosen
    with pytest.raises(ValueError, match="isa"):
        native.choose_tiles_isa("sse9")
