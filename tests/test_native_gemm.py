"""The prefill GEMM (csrc/gemm/matmul_gemm.c, nanoserve.native.repack.gemm): a prompt chunk's rows get
the bits the x8 GEMV gives each row alone, within the float64 bound of tests/test_quant.py, on
ragged shapes and large row counts; its scalar reference gives the vector path's bits; the
`native-quant-gemm` kernel routes chunks by row count and passes the batch-invariance self-test
across that threshold."""

from __future__ import annotations

import pytest
import torch
from test_quant import assert_within_bound, random_weight

from nanoserve import native
from nanoserve.model.linear import GEMM_MIN_ROWS, QUANTIZED_KERNELS, ProbeShape, self_test

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")

FORMATS = ("q4_0", "q4_1", "q8_0")
# N odd, N below one group of 8, N a multiple of 8; K one block, and not a multiple of 256.
SHAPES = [(1, 32), (37, 96), (19, 608), (64, 576)]
ROW_COUNTS = (*range(1, 18), 64, 65, 130, 257)  # past one 64-row panel, and ragged tiles of 4


def _repack():
    from nanoserve.native import repack

    return repack


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_gemm_rows_have_the_bits_of_the_gemv_alone_and_of_the_scalar_reference(format_name, out_features,
                                                                             in_features):
    repack = _repack()
    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    packed = repack.repack(weight)
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(in_features))
    alone = torch.cat([repack.matmul(x[r : r + 1], packed) for r in range(x.shape[0])])
    for rows in ROW_COUNTS:
        y = repack.gemm(x[:rows], packed)
        assert_within_bound(y, x[:rows], weight)
        assert torch.equal(y, alone[:rows]), f"{rows} rows"
        assert torch.equal(y, repack.gemm(x[:rows], packed, portable=True)), f"{rows} rows, portable"


def test_gemm_bits_do_not_depend_on_the_thread_count():
    repack = _repack()
    packed = repack.repack(random_weight("q8_0", 203, 608))
    x = torch.randn(70, 608, generator=torch.Generator().manual_seed(3))
    assert torch.equal(repack.gemm(x, packed, threads=2), repack.gemm(x, packed, threads=1))


def test_gemm_refuses_an_input_that_does_not_multiply_before_reaching_c():
    repack = _repack()
    packed = repack.repack(random_weight("q4_1", 8, 64))
    with pytest.raises(ValueError, match=r"x must be float32 \[rows, 64\]"):
        repack.gemm(torch.zeros(3, 32), packed)
    with pytest.raises(ValueError, match="float32"):
        repack.gemm(torch.zeros(3, 64, dtype=torch.float64), packed)


def test_gemm_kernel_sends_chunks_to_the_gemm_and_decode_rows_to_the_gemv(monkeypatch):
    repack = _repack()
    kernel = QUANTIZED_KERNELS["native-quant-gemm"]
    packed = kernel.pack(random_weight("q4_1", 24, 96))
    chunk = torch.randn(GEMM_MIN_ROWS, 96, generator=torch.Generator().manual_seed(5))
    expected = repack.matmul(chunk, packed)

    def refuse(*args, **kwargs):
        raise AssertionError("the wrong kernel ran")

    with monkeypatch.context() as patch:
        patch.setattr(repack, "matmul", refuse)
        assert torch.equal(kernel.apply(chunk, packed), expected)
    with monkeypatch.context() as patch:
        patch.setattr(repack, "gemm", refuse)
        assert torch.equal(kernel.apply(chunk[:-1], packed), expected[:-1])


@pytest.mark.parametrize("format_name", FORMATS)
def test_gemm_kernel_passes_the_batch_invariance_self_test_across_its_threshold(format_name):
    layer = [random_weight(format_name, 40, 96, seed=1), random_weight(format_name, 33, 96, seed=2)]
    shape = ProbeShape([layer], random_weight(format_name, 17, 96, seed=3))
    assert self_test(QUANTIZED_KERNELS["native-quant-gemm"], shape, max_rows=GEMM_MIN_ROWS + 2,
                     prefill_rows=70) == ""


def test_the_gemm_kernel_is_a_candidate_exactly_where_no_wider_tile_outruns_it():
    """On the ISAs of GEMM_OUTRUN_ON the kernel choice leaves it out, saying why; elsewhere it is
    timed beside the x8 tiles. Forcing it where it is left out is refused naming the reason."""
    from nanoserve.model.linear import GEMM_OUTRUN_ON, KernelUnavailableError, choose_kernel, left_out

    cpu = torch.device("cpu")
    outrun = native.library().tiles_isa in GEMM_OUTRUN_ON
    assert ("native-quant-gemm" in left_out(cpu)) == outrun
    shape = ProbeShape([[random_weight("q4_1", 16, 64)]], random_weight("q8_0", 16, 64))
    if outrun:
        reason = f"native-quant-gemm.*tiles on {native.library().tiles_isa}"
        with pytest.raises(KernelUnavailableError, match=reason):
            choose_kernel(shape, device=cpu, max_rows=2, prefill_rows=16, batch_invariant=True,
                          forced="native-quant-gemm")
    else:
        choice = choose_kernel(shape, device=cpu, max_rows=2, prefill_rows=16, batch_invariant=True,
                               forced="native-quant-gemm")
        assert choice.kernel.name == "native-quant-gemm"
