"""GGUF block formats: the torch reference against gguf's own code, and the native kernels
against a float64 product of the same dequantized weights.

Tolerance of the kernels: they quantize each activation row to 8-bit blocks of 32 (scale
d = max|x| / 127, codes rounded to nearest), as llama.cpp does, so an activation moves by at
most d/2 per element. An output then errs by at most sum over blocks of (d_b / 2) * sum |w| over
the block's weights, which is the bound each output is held to (plus float32 rounding slack);
the error a real activation sees is far below it, since the roundings mostly cancel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from nanoserve import native, quant
from nanoserve.model.linear import QUANTIZED_KERNELS, ProbeShape, choose_kernel, self_test
from nanoserve.quant import FORMATS, QUANTIZERS, QuantizedStack, QuantizedWeight, quantize, stack_rows

needs_native = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")

# The 16-bit float types: their kernels take the activations as they are.
_FLOAT_FORMATS = ("f16", "bf16")


def random_weight(format_name: str, out_features: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    """Random codes and sane f16 scales in `format_name` (nanoserve.quant.random_weight)."""
    return quant.random_weight(format_name, out_features, in_features,
                               generator=torch.Generator().manual_seed(seed))


def activation_bound(x: torch.Tensor, dense: torch.Tensor, format_name: str) -> torch.Tensor:
    """[rows, out]: the most 8-bit activation blocks of 32 can move each output (module doc);
    nothing for F16 / BF16, whose kernels take the activations as they are."""
    rows, k = x.shape
    if format_name in _FLOAT_FORMATS:
        return torch.zeros(rows, dense.shape[0], dtype=torch.float64)
    half_step = (x.abs().reshape(rows, k // 32, 32).amax(-1) / 127 / 2).double()  # [rows, blocks]
    weight_mass = dense.abs().reshape(dense.shape[0], k // 32, 32).sum(-1)  # [out, blocks]
    return half_step @ weight_mass.T


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> None:
    dense = weight.dequantize().double()
    exact = x.double() @ dense.T
    # float32 rounding: F16 / BF16's 8-lane FMA chains run k / 16 steps, then a few sums and the
    # tail; the block formats' slack is looser, beside their far larger activation bound.
    rounding = (x.shape[1] / 16 + 16) * 2.0 ** -24 if weight.format.name in _FLOAT_FORMATS else 1e-5
    magnitude = x.double().abs() @ dense.abs().T
    bound = activation_bound(x, dense, weight.format.name) + rounding * magnitude + 1e-6
    excess = (y.double() - exact).abs() - bound
    assert float(excess.max()) <= 0, f"{weight.format.name} {weight.shape} x {list(x.shape)}"


@pytest.mark.parametrize("format_name", FORMATS)
def test_reference_dequantizer_is_gguf_dequantize_bit_for_bit(format_name):
    weight = random_weight(format_name, 6, 512)
    expected = gguf_dequantize(weight.blocks.numpy(), GGMLQuantizationType[format_name.upper()])
    ours = weight.dequantize().numpy()
    assert ours.shape == expected.shape
    assert np.array_equal(ours.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("format_name", QUANTIZERS)
def test_quantizer_writes_the_bytes_gguf_quantize_writes(format_name):
    values = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    values[0, :32] = 0  # an all-zero block: scale 0, no division by it
    values[1, :32] = values[1, :32].abs()  # the largest magnitude positive (Q4_0's sign rule)
    expected = gguf_quantize(values.numpy(), GGMLQuantizationType[format_name.upper()])
    assert np.array_equal(quantize(values, format_name).blocks.numpy(), expected)


def test_quantizer_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        quantize(torch.zeros(4, 48), "q8_0")


def test_mixed_formats_stack_part_by_part():
    q, v = random_weight("q4_k", 8, 256), random_weight("q6_k", 4, 256)
    stacked = stack_rows([q, v])
    assert isinstance(stacked, QuantizedStack) and stacked.shape == (12, 256)
    assert torch.equal(stacked.dequantize(), torch.cat([q.dequantize(), v.dequantize()]))


# ---- native kernels -----------------------------------------------------------------------------

# (format, out features, in features): N odd; K one block, several blocks, and not a multiple
# of 256 where the format allows it.
RAGGED_SHAPES = [(f, n, k) for f in ("q8_0", "q4_0", "q4_1") for n, k in ((1, 32), (37, 96), (19, 608))]
RAGGED_SHAPES += [(f, n, k) for f in ("q4_k", "q5_k", "q6_k") for n, k in ((1, 256), (37, 512), (5, 768))]
RAGGED_SHAPES += [(f, n, k) for f in ("q5_0", "q5_1", "iq4_nl") for n, k in ((1, 32), (37, 96), (19, 608))]
RAGGED_SHAPES += [(f, n, k) for f in ("iq4_xs", "q2_k", "q3_k") for n, k in ((1, 256), (37, 512), (5, 768))]
# F16 / BF16 take any K: shorter than one 8-lane group, one group and a tail, whole groups
RAGGED_SHAPES += [(f, n, k) for f in ("f16", "bf16") for n, k in ((1, 7), (37, 100), (19, 611), (3, 64))]


@needs_native
@pytest.mark.parametrize(("format_name", "out_features", "in_features"), RAGGED_SHAPES)
def test_kernel_agrees_with_float64_within_the_activation_rounding_bound(format_name, out_features,
                                                                         in_features):
    from nanoserve.native import quant as native_quant

    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    generator = torch.Generator().manual_seed(in_features)
    for rows in (*range(1, 18), 33, 130):
        x = torch.randn(rows, in_features, generator=generator)
        assert_within_bound(native_quant.matmul(x, weight), x, weight)


@needs_native
@pytest.mark.parametrize("format_name", FORMATS)
def test_portable_path_agrees_with_the_vector_path(format_name):
    from nanoserve.native import quant as native_quant

    weight = random_weight(format_name, 23, 512)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    fast, portable = native_quant.matmul(x, weight), native_quant.matmul(x, weight, portable=True)
    assert_within_bound(portable, x, weight)
    if format_name in _FLOAT_FORMATS:  # the same fmaf chains, in the same order (matmul_more.c)
        assert torch.equal(fast, portable)
        return
    # Both sum the same integer products; only the float accumulation order differs.
    assert torch.allclose(fast, portable, rtol=1e-5, atol=1e-5 * float(fast.abs().max()))


@needs_native
@pytest.mark.parametrize("format_name", FORMATS)
def test_native_row_lookup_matches_the_reference_dequantizer(format_name):
    from nanoserve.native import quant as native_quant

    weight = random_weight(format_name, 11, 512)
    ids = torch.tensor([[3, 0], [10, 3]])
    expected = weight.dequantize()[ids]
    assert torch.allclose(native_quant.dequantize_rows(weight, ids), expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(IndexError):
        native_quant.dequantize_rows(weight, torch.tensor([11]))


@needs_native
def test_kernel_refuses_activations_of_the_wrong_shape_before_touching_a_pointer():
    from nanoserve.native import quant as native_quant

    with pytest.raises(ValueError, match="float32"):
        native_quant.matmul(torch.zeros(2, 64), random_weight("q8_0", 4, 96))


@needs_native
@pytest.mark.parametrize("format_name", ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "q5_0", "q5_1", "iq4_nl",
                                         "iq4_xs", "q2_k", "q3_k", "f16", "bf16"])
def test_quantized_kernel_passes_the_batch_invariance_self_test(format_name):
    k = {256: 256, 32: 96, 1: 100}[FORMATS[format_name].values]
    layer = [random_weight(format_name, 40, k, seed=1), random_weight(format_name, 33, k, seed=2)]
    shape = ProbeShape([layer], random_weight(format_name, 17, k, seed=3))
    assert self_test(QUANTIZED_KERNELS["native-quant"], shape, max_rows=9, prefill_rows=40) == ""


@needs_native
def test_kernel_choice_takes_the_quantized_kernel_for_blocks(tmp_path):
    layer = [random_weight("q4_1", 64, 96)]
    shape = ProbeShape([layer], random_weight("q8_0", 32, 96))
    choice = choose_kernel(shape, device=torch.device("cpu"), max_rows=4, prefill_rows=16,
                           batch_invariant=True, cache_path=tmp_path / "kernels.json")
    assert choice.kernel.name in QUANTIZED_KERNELS and choice.batch_invariant


# ---- batch invariance of a model in its own quantization ------------------------------------------


@needs_native
@pytest.mark.real_model
def test_default_model_in_its_quantization_gives_every_request_its_solo_tokens_and_logprobs(
        default_model_dir):
    from test_batch_invariance import crowd_prompts, fingerprint, params_for, staggered_crowd

    from nanoserve.llm import LLM

    llm = LLM(device="cpu", kv_cache_gb=0.25)  # the default: Q4_1 blocks, Q8_0 head
    assert llm.engine.weight_format == "q4_1+q8_0"
    assert llm.engine.kernel_choice.kernel.name in QUANTIZED_KERNELS
    prompts, params = crowd_prompts(8), [params_for(i) for i in range(8)]
    alone = [fingerprint(llm.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(llm, prompts, params) == alone
