"""Q4_K, Q5_K, Q6_K and IQ4_XS repacked at load (nanoserve.native.repack.repack_k, csrc/matmul_kx8.c): the
layout holds the file's values bit for bit, the kernel agrees with a float64 product within the
activation rounding bound (tests/test_quant.py's module doc) on ragged shapes, its scalar
reference gives the vector path's bits, and a row's bits never depend on its neighbours, the
tile it lands in or the thread count."""

from __future__ import annotations

import pytest
import torch
from test_quant import assert_within_bound, random_weight

from nanoserve import native
from nanoserve.model.linear import QUANTIZED_KERNELS, ProbeShape, self_test
from nanoserve.quant import QuantizedStack, QuantizedWeight

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")

FORMATS = ("q4_k", "q5_k", "q6_k", "iq4_xs")
# N odd, N below one group of 8, N a multiple of 8; K one, two, three and six super-blocks.
SHAPES = [(1, 256), (37, 512), (19, 768), (64, 1536)]
ROW_COUNTS = (*range(1, 18), 33, 130)  # past one 32-row panel, and ragged tiles of 3


def _repack():
    from nanoserve.native import repack

    return repack


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_layout_reads_back_as_the_reference_dequantizer_gives_the_file(format_name, out_features,
                                                                       in_features):
    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    packed = _repack().repack_k(weight)
    assert isinstance(packed, _repack().KRepackedWeight)
    assert torch.equal(packed.dequantize(), weight.dequantize())


@pytest.mark.parametrize("format_name", FORMATS)
def test_layout_is_the_files_bytes_up_to_padding_and_q4_k_unpacked_scales(format_name):
    weight = random_weight(format_name, 37, 512)
    # Q4_K's and Q5_K's 12 bytes of packed 6-bit scales and mins are 16 bytes unpacked, IQ4_XS's
    # 6 bytes of 6-bit scales 8
    per_super_block = {"q4_k": 148, "q5_k": 180, "q6_k": 210, "iq4_xs": 138}[format_name]
    assert _repack().repack_k(weight).nbytes == 40 * 2 * per_super_block


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_kernel_agrees_with_float64_and_a_row_alone_has_its_bits_in_any_chunk(format_name, out_features,
                                                                            in_features):
    repack = _repack()
    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    packed = repack.repack_k(weight)
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(in_features))
    alone = torch.cat([repack.matmul_k(x[r : r + 1], packed) for r in range(x.shape[0])])
    assert torch.equal(alone, torch.cat([repack.matmul_k(x[r : r + 1], packed, portable=True)
                                         for r in range(x.shape[0])]))
    for rows in ROW_COUNTS:
        y = repack.matmul_k(x[:rows], packed)
        assert_within_bound(y, x[:rows], weight)
        assert torch.equal(y, alone[:rows]), f"{rows} rows"
        assert torch.equal(y, repack.matmul_k(x[:rows], packed, portable=True)), f"{rows} rows, portable"


def test_extreme_codes_and_scales_stay_exact():
    """Every Q6_K code at -32 against activations at +-127 fills the int16 sums to their bound;
    Q4_K's codes at 15 (Q5_K's at 31) with 6-bit scales at 63 likewise; IQ4_XS's codes at the grid's -127 fill
    each maddubs pair (32258) and its scales at -32 the int32 sums: the vector path must still
    give the scalar reference's bits."""
    repack = _repack()
    x = torch.full((5, 512), 1.0)  # every activation code at +127, then at -127
    x[3:] = -1.0
    extremes = (("q6_k", slice(0, 192)), ("q4_k", slice(16, 144)), ("q5_k", slice(16, 176)),
                ("iq4_xs", slice(2, 136)))
    for format_name, code_bytes in extremes:
        weight = random_weight(format_name, 9, 512)
        blocks = weight.blocks.reshape(-1, weight.format.bytes).clone()
        blocks[:, code_bytes] = 0xFF if format_name in ("q4_k", "q5_k") else 0x00  # IQ4_XS: scales at -32
        if format_name in ("q4_k", "q5_k"):
            blocks[:, 4:16] = 0xFF  # every 6-bit scale and min at 63
        elif format_name == "q6_k":
            blocks[:, 192:208] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
        extreme = QuantizedWeight(weight.format, weight.shape, blocks.reshape(9, -1))
        packed = repack.repack_k(extreme)
        y = repack.matmul_k(x, packed)
        assert torch.equal(y, repack.matmul_k(x, packed, portable=True)), format_name
        assert_within_bound(y, x, extreme)


def test_kernel_bits_do_not_depend_on_the_thread_count():
    repack = _repack()
    packed = repack.repack_k(random_weight("q4_k", 203, 768))
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [repack.matmul_k(x[:rows], packed) for rows in (3, 40)]
        torch.set_num_threads(2)
        for rows, y in zip((3, 40), one, strict=True):
            assert torch.equal(repack.matmul_k(x[:rows], packed), y)
    finally:
        torch.set_num_threads(before)


def test_formats_without_a_k_layout_stay_in_the_files_layout():
    for format_name in ("f16", "q4_1"):
        weight = random_weight(format_name, 8, 256)
        assert _repack().repack_k(weight) is weight


@pytest.mark.parametrize("kernel_name", ["native-quant-x8", "native-quant-gemm"])
def test_repacking_kernels_run_k_quants_in_their_layout_and_pass_the_self_test(kernel_name):
    kernel = QUANTIZED_KERNELS[kernel_name]
    stack = QuantizedStack((random_weight("q4_k", 12, 512, seed=1), random_weight("q6_k", 9, 512, seed=2),
                            random_weight("q4_1", 8, 512, seed=3)))
    packed = kernel.pack(stack)
    repack = _repack()
    layouts = [repack.KRepackedWeight, repack.KRepackedWeight, repack.RepackedWeight]
    assert [type(p) for p in packed.parts] == layouts
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(4))
    y = kernel.apply(x, packed)
    for part, columns in zip(stack.parts, (slice(0, 12), slice(12, 21), slice(21, 29)), strict=True):
        assert_within_bound(y[:, columns], x, part)
    layer = [random_weight("q4_k", 40, 512, seed=5), random_weight("q6_k", 33, 512, seed=6), stack]
    shape = ProbeShape([layer], random_weight("q6_k", 17, 512, seed=7))
    assert self_test(kernel, shape, max_rows=18, prefill_rows=70) == ""


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_a_k_quant_gguf_runs_in_the_layout_and_a_request_alone_equals_it_in_a_crowd(type_name, tmp_path):
    from families import crowd_logits, load_model, prefill_logits
    from gguf import GGMLQuantizationType
    from tiny_model import write_tiny_gguf, write_tiny_llama

    from nanoserve.loading.weights import load_weights
    from nanoserve.model.decoder import Llama

    model_dir = write_tiny_llama(tmp_path / "wide", hidden_size=256, intermediate_size=512, num_heads=4,
                                 num_kv_heads=2)
    path = write_tiny_gguf(tmp_path / "wide.gguf", model_dir, matrix_type=GGMLQuantizationType[type_name])
    config, weights = load_weights(model_dir, dtype=torch.float32, device=torch.device("cpu"), gguf=path)
    model = Llama(config, weights, batch_invariant=True, linear_kernel=QUANTIZED_KERNELS["native-quant-x8"])
    assert isinstance(model.weights.layers[0].down, _repack().KRepackedWeight)
    lengths = (13, 21, 20)  # c arrives in chunks of 10 (families.crowd_logits)
    prompts = [[(7 * i + 3 * seq) % config.vocab_size for i in range(n)] for seq, n in enumerate(lengths)]
    alone, crowd = crowd_logits(model, prompts, crowd=False), crowd_logits(model, prompts, crowd=True)
    assert all(torch.equal(a, c) for a, c in zip(alone, crowd, strict=True))
    assert torch.equal(prefill_logits(model, prompts[1], chunk=5), prefill_logits(model, prompts[1]))
    exact = prefill_logits(load_model(model_dir, gguf=path), prompts[1])
    ours = prefill_logits(model, prompts[1])
    # Activations rounded to 8 bits per block of 32 move the logits by a percent or so.
    assert float((ours - exact).abs().max()) <= 0.05 * float(exact.abs().max())
