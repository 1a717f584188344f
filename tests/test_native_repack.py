"""Blocks repacked at load (nanoserve.native.repack, csrc/gemm/matmul_x8.c): the layout holds the file's
values, the kernel agrees with a float64 product within the activation rounding bound
(tests/test_quant.py's module doc) on ragged shapes, the vector path gives the portable path's
bits, and a row's bits never depend on its neighbours or the thread count."""

from __future__ import annotations

import pytest
import torch
from test_quant import assert_within_bound, random_weight

from nanoserve import native, quant
from nanoserve.model.linear import (
    QUANTIZED_KERNELS,
    ProbeShape,
    choose_kernel,
    embedding,
    left_out,
    self_test,
)
from nanoserve.quant import QuantizedStack, QuantizedWeight

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")

REPACKED_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl")
# N odd, N below one group of 8, N a multiple of 8; K one block, and not a multiple of 256.
SHAPES = [(1, 32), (37, 96), (19, 608), (64, 576)]


def _repack():
    from nanoserve.native import repack

    return repack


@pytest.mark.parametrize("format_name", REPACKED_FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_repacked_rows_read_back_as_the_reference_dequantizer_gives_them(format_name, out_features,
                                                                         in_features):
    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    repacked = _repack().repack(weight)
    assert isinstance(repacked, _repack().RepackedWeight)
    ids = torch.arange(out_features).flip(0)
    assert torch.allclose(repacked.lookup(ids), weight.dequantize()[ids], rtol=1e-6, atol=1e-7)
    with pytest.raises(IndexError):
        repacked.lookup(torch.tensor([out_features]))


@pytest.mark.parametrize("format_name", ["q4_1", "q5_1", "q8_0", "iq4_nl"])
def test_repacking_keeps_the_files_bytes_up_to_the_padding_to_eight_columns(format_name):
    weight = random_weight(format_name, 37, 96)
    assert _repack().repack(weight).nbytes == weight.nbytes // 37 * 40


@pytest.mark.parametrize("format_name", REPACKED_FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_kernel_agrees_with_float64_the_vector_path_gives_the_portable_bits_and_a_row_alone_its_own(
        format_name, out_features, in_features):
    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    repacked = _repack().repack(weight)
    row_counts = (*range(1, 18), 33, 130)  # every tile of 1..8 rows alone and split, past a 32-row panel
    x = torch.randn(max(row_counts), in_features, generator=torch.Generator().manual_seed(in_features))
    alone = torch.cat([_repack().matmul(x[r : r + 1], repacked) for r in range(x.shape[0])])
    for rows in row_counts:
        y = _repack().matmul(x[:rows], repacked)
        assert_within_bound(y, x[:rows], weight)
        assert torch.equal(y, alone[:rows]), f"{rows} rows"
        assert torch.equal(y, _repack().matmul(x[:rows], repacked, portable=True)), f"{rows} rows, portable"


@pytest.mark.parametrize("format_name", ["q4_1", "q5_0"])
def test_a_rows_bits_do_not_depend_on_the_thread_count(format_name):
    repacked = _repack().repack(random_weight(format_name, 203, 608))
    x = torch.randn(9, 608, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_repack().matmul(x, repacked, threads=2), _repack().matmul(x, repacked, threads=1))


def test_q5_0_is_held_as_q5_1_with_the_offset_of_its_codes():
    weight = random_weight("q5_0", 16, 64)
    repacked = _repack().repack(weight)
    assert repacked.layout.name == "q5_1" and repacked.nbytes == weight.nbytes // 22 * 24
    assert torch.equal(repacked.lookup(torch.arange(16)), weight.dequantize())


@pytest.mark.parametrize("format_name", ["q5_0", "q5_1"])
def test_extreme_five_bit_codes_stay_exact(format_name):
    """Every code 31 (or 0) against activations at +-127: the int16 sums sit at their limit."""
    weight = random_weight(format_name, 8, 256)
    base = 2 if format_name == "q5_0" else 4
    for fill in (0x00, 0xFF):
        blocks = weight.blocks.clone().reshape(-1, weight.format.bytes)
        blocks[:, base:] = fill
        assert_exact_against_extreme_activations(quant.QuantizedWeight(weight.format, weight.shape,
                                                                       blocks.reshape(8, -1)))


def assert_exact_against_extreme_activations(extreme: quant.QuantizedWeight) -> None:
    """Activation codes at +-127 against `extreme`'s codes: the vector path gives the scalar
    reference's bits, and both the float64 product."""
    repacked = _repack().repack(extreme)
    x = torch.tensor([[1.0, -1.0] * 128, [1.0] * 256, [-1.0] * 256])
    y = _repack().matmul(x, repacked)
    assert torch.equal(y, _repack().matmul(x, repacked, portable=True))
    exact = x.double() @ extreme.dequantize().double().T
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5)


def test_extreme_iq4_nl_codes_stay_exact():
    """Every code at the grid's -127 against activations at +-127: each maddubs pair sits at
    32258, so a chunk's pairs must widen before the next chunk adds."""
    weight = random_weight("iq4_nl", 8, 256)
    blocks = weight.blocks.clone().reshape(-1, weight.format.bytes)
    blocks[:, 2:] = 0x00
    assert_exact_against_extreme_activations(quant.QuantizedWeight(weight.format, weight.shape,
                                                                   blocks.reshape(8, -1)))


def test_formats_without_a_layout_stay_in_the_files_layout():
    weight = random_weight("q4_k", 8, 256)
    assert _repack().repack(weight) is weight


@pytest.mark.parametrize("format_name", REPACKED_FORMATS)
def test_repacked_kernel_passes_the_batch_invariance_self_test(format_name):
    layer = [random_weight(format_name, 40, 96, seed=1), random_weight(format_name, 33, 96, seed=2)]
    shape = ProbeShape([layer], random_weight(format_name, 17, 96, seed=3))
    assert self_test(QUANTIZED_KERNELS["native-quant-x8"], shape, max_rows=9, prefill_rows=70) == ""


def test_the_gemm_kernel_runs_layouts_the_gemm_lacks_through_the_x8_tiles():
    kernel = QUANTIZED_KERNELS["native-quant-gemm"]
    weight = random_weight("q5_0", 40, 96, seed=1)
    packed = kernel.pack(weight)
    assert not _repack().has_gemm(packed)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(2))
    assert torch.equal(kernel.apply(x, packed), _repack().matmul(x, packed))
    layer = [weight, random_weight("q5_1", 33, 96, seed=2)]
    shape = ProbeShape([layer], random_weight("q5_0", 17, 96, seed=3))
    assert self_test(kernel, shape, max_rows=9, prefill_rows=70) == ""


def q4_0_whose_offset_overflows_f16(out_features: int, in_features: int) -> QuantizedWeight:
    """A Q4_0 matrix with one scale (16384) whose Q4_1 offset m = -8 d is past f16's range."""
    weight = random_weight("q4_0", out_features, in_features)
    large = torch.tensor([16384.0], dtype=torch.float16).view(torch.uint8)
    weight.blocks.view(out_features, -1, 18)[0, 0, :2] = large
    return weight


def test_a_q4_0_matrix_whose_offset_overflows_f16_stays_in_the_files_layout():
    weight = q4_0_whose_offset_overflows_f16(8, 64)
    assert _repack().repack(weight) is weight


def test_a_stack_of_formats_repacks_the_parts_that_have_a_layout():
    q, v = q4_0_whose_offset_overflows_f16(8, 256), random_weight("q8_0", 12, 256, seed=1)
    kernel = QUANTIZED_KERNELS["native-quant-x8"]
    packed = kernel.pack(QuantizedStack((q, v)))
    assert isinstance(packed.parts[0], QuantizedWeight)
    assert isinstance(packed.parts[1], _repack().RepackedWeight)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    y = kernel.apply(x, packed)
    assert_within_bound(y[:, :8], x, q)
    assert_within_bound(y[:, 8:], x, v)


def test_a_tied_table_packed_for_the_head_serves_the_embedding_once():
    from nanoserve.model.weights import LayerWeights, LlamaWeights

    table = random_weight("q8_0", 24, 64)
    layer = LayerWeights(torch.ones(64), random_weight("q4_1", 16, 64), random_weight("q4_1", 64, 64),
                         torch.ones(64), random_weight("q4_1", 32, 64), random_weight("q4_1", 64, 32))
    weights = LlamaWeights(table, [layer], torch.ones(64), table)
    packed = weights.packed_for(QUANTIZED_KERNELS["native-quant-x8"])
    assert packed.embed is packed.lm_head and quant.serves_lookups(packed.embed)
    ids = torch.tensor([[5, 23], [0, 5]])
    assert torch.allclose(embedding(ids, packed.embed), table.dequantize()[ids], rtol=1e-6, atol=1e-7)


def test_kernel_choice_measures_both_quantized_layouts(tmp_path):
    shape = ProbeShape([[random_weight("q4_1", 64, 96)]], random_weight("q8_0", 32, 96))
    choice = choose_kernel(shape, device=torch.device("cpu"), max_rows=4, prefill_rows=16,
                           batch_invariant=True, cache_path=tmp_path / "kernels.json")
    # the GEMM is timed where it is not left out (on AVX-512 VNNI the block tiles outrun it)
    expected = {"native-quant", "native-quant-x8", "native-quant-gemm"} - set(left_out(torch.device("cpu")))
    assert set(choice.verdicts) == expected and "native-quant-x8" in expected
    assert all(v.ms_by_rows for v in choice.verdicts.values())
    assert choice.batch_invariant and choice.verdicts[choice.kernel.name].invariant
